"""kvmesh scheduler service."""
