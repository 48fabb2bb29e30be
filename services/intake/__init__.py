"""kvmesh intake service."""
