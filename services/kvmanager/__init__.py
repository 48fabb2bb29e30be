"""kvmesh kvmanager service."""
