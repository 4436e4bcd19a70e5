"""One step's integer metadata, staged on the host and sent to the device in one copy.

Sections (input ids, positions, slot mapping, LoRA segments, ...) sit at fixed offsets of one int32
buffer on each side, sized for the largest step. A step fills the host sections it uses, then
``upload`` copies the whole buffer once; the device views never move, so a CUDA graph captured on
them reads each step's values. On a CPU device the host buffer is the device buffer: nothing is copied.
"""

from __future__ import annotations

import torch


class StepBuffer:
    def __init__(self, sections: dict[str, int], device: torch.device | str, separate: bool | None = None) -> None:
        """``sections``: name -> number of int32 elements; ``separate``: whether the device buffer is a
        buffer of its own (default: on any device but the CPU; tests set it to run the copy on CPU)."""
        device = torch.device(device)
        self._offsets: dict[str, tuple[int, int]] = {}
        total = 0
        for name, size in sections.items():
            self._offsets[name] = (total, size)
            total += size
        on_cuda = device.type == "cuda"
        # Pinned host memory lets the copy run asynchronously on CUDA.
        self.host = torch.zeros(total, dtype=torch.int32, pin_memory=on_cuda)  # [total]
        separate = device.type != "cpu" if separate is None else separate
        self.device = torch.zeros(total, dtype=torch.int32, device=device) if separate else self.host
        self._copied = torch.cuda.Event() if on_cuda else None  # the last upload's copy has run

    def wait_for_upload(self) -> None:
        """Blocks until the last upload's copy has run: call before rewriting the host sections (a step
        that samples nothing never waits on the device, so its copy may still be queued)."""
        if self._copied is not None:
            self._copied.synchronize()

    def host_view(self, name: str) -> torch.Tensor:
        start, size = self._offsets[name]
        return self.host[start : start + size]

    def device_view(self, name: str) -> torch.Tensor:
        start, size = self._offsets[name]
        return self.device[start : start + size]

    def upload(self) -> None:
        """Copies every host section to the device (asynchronously on CUDA; the host buffer must not be
        rewritten before the copy has run: ``wait_for_upload``)."""
        if self.device is not self.host:
            self.device.copy_(self.host, non_blocking=True)
            if self._copied is not None:
                self._copied.record()
