"""The trainer side's edges, and the only modules that import torch.

* ``collate``  — reader batches → padded or packed (THD) tensors
* ``megatron`` — replay indices for megatron-core's ``RouterReplay`` (R3)
* ``skyrl``    — reader batches as SkyRL's ``GeneratorOutput``
* ``verl``     — reader batches as verl's ``DataProto``

The reader itself (``trajstore.reader``) is core and torch-free.
"""

__all__: list[str] = []
