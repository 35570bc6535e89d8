"""What the transports and the clients share: tensors in safetensors and raw bytes, dtype names,
shape checks (``tensors``); one parser per option (``options``); the Open Inference Protocol apart
from its framing (``oip``)."""
