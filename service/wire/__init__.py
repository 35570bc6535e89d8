"""Wire formats shared by the transports and the clients: tensors in safetensors and raw bytes,
dtype names, shape checks (``tensors``)."""
