"""Replaying the scheduler over a recorded window of topics.

``record`` (``kvmesh record``) copies a window of the topics to a file; ``replayer`` rebuilds the
FleetView from it in record order and re-runs ``Router.decide`` for every recorded request, setting
the replayed decision beside the recorded one; ``__main__`` is ``kvmesh replay``.
"""
