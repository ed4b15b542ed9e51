"""What guardian tells Prometheus: its own metrics (metrics.py), served over HTTP (http.py) or
written for node_exporter's textfile collector, and the replicas as file_sd targets (files.py)."""
