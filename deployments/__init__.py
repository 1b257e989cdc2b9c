"""The Ray Serve layer over `rollout`: worker replicas, the ingress, and the app builder."""
