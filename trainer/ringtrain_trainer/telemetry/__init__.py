"""What a worker tells people and machines: metrics, TensorBoard, progress lines, its last words.

``metrics`` (Prometheus and ``/status``), ``tensorboard`` (event files), ``reporting`` (the
progress events and throughput), ``startup`` (the start-up line: what runs), ``termlog`` (the
termination message Kubernetes reads).
"""
