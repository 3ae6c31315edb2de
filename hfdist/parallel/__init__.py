"""Parallelism surgery: tensor (TP), pipeline (PP) and fully-sharded data parallelism (FSDP2) on a DeviceMesh."""
