"""The four kvmesh services: intake, scheduler, worker, kvmanager (each runnable as python -m services.X)."""
