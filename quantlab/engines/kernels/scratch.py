"""Per-device scratch of the kernels that combine partial results across programs: an fp32 workspace and int32
counters, grown as needed. Counters are zero between launches (the last program of a tile re-arms its own).
Replaced buffers are kept alive: a captured CUDA graph may still point at them."""
from __future__ import annotations

import torch


class Scratch:
    """One kernel family's scratch, per device; buffers are allocated at least min_floats / min_counters long."""

    def __init__(self, min_floats: int, min_counters: int):
        self.min_floats, self.min_counters = min_floats, min_counters
        self.held: dict[str, dict] = {}  # device -> {"ws", "cnt", "kept": every buffer ever handed out}

    def get(self, device: torch.device, floats: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(workspace of at least `floats` fp32, at least `counters` zeroed int32 counters) on device."""
        held = self.held.setdefault(str(device), {"ws": None, "cnt": None, "kept": []})
        if held["ws"] is None or held["ws"].numel() < floats:
            held["ws"] = torch.empty(max(floats, self.min_floats), dtype=torch.float32, device=device)
            held["kept"].append(held["ws"])
        if held["cnt"] is None or held["cnt"].numel() < counters:
            held["cnt"] = torch.zeros(max(counters, self.min_counters), dtype=torch.int32, device=device)
            held["kept"].append(held["cnt"])
        return held["ws"], held["cnt"]

    def reset_counters(self) -> None:
        """Zero every device's counters (after a launch that may have stopped half way)."""
        for held in self.held.values():
            if held["cnt"] is not None:
                held["cnt"].zero_()

    def check_case(self, row: dict, launch, exact, bound, shape: tuple, dtype):
        """One case of a kernel's check against its exact arithmetic: launch() gives the output, row["worst"] is its
        largest error over the bound (inf for a wrong shape or dtype) and row["ok"] whether that is at most 1; a
        launch that raises is row["error"], with the counters re-armed (it may have stopped half way). Returns the
        output on the CPU, or None when it failed or has the wrong shape."""
        try:
            y = launch().cpu()
        except Exception as exc:  # noqa: BLE001 - reported as a failed case
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            self.reset_counters()
            return None
        ok_shape = y.dtype == dtype and tuple(y.shape) == tuple(shape)
        row["worst"] = float(((y.double() - exact).abs() / bound).max()) if ok_shape else float("inf")
        row["ok"] = ok_shape and row["worst"] <= 1.0
        return y if ok_shape else None

    def clear(self) -> None:
        """Drop every buffer (after a failed launch in a check, where no graph holds them)."""
        self.held.clear()
