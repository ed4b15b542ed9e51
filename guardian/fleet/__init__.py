"""Coordination across a fleet of boxes on etcd (README, A fleet)."""
