"""CUDA C++ kernels compiled at run time with NVRTC (the runtime compiler torch's CUDA builds ship) and launched
through the CUDA driver, both by ctypes: no nvcc, no build step, no extension module.

`compile_kernels(source, names, arch)` returns the CUBIN and each name expression's lowered (mangled) symbol;
`Module` loads a CUBIN on the current device and launches its kernels on torch's current stream (so CUDA graphs
capture the launches and torch.compile can run them inside a custom op). Everything that can fail raises
`RtcError` with the library's own message; callers check the kernel's numbers before they use it (int4.mma_usable).
"""
from __future__ import annotations

import ctypes
import functools
import glob
import logging
import os
import sys

import torch

from quantlab.engines.kernels.device import PDL_REFUSED


class RtcError(RuntimeError):
    """NVRTC or the CUDA driver is missing or refused a step (the message says which and why)."""


def _candidates(stem: str) -> list[str]:
    """Where a CUDA library may be: by soname (already loaded by torch, or on the loader's path), then the copies
    pip's nvidia-* wheels put under site-packages."""
    major = (torch.version.cuda or "12").split(".")[0]
    names = [f"{stem}.so.{major}", f"{stem}.so"]
    for base in sys.path:
        names += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", f"{stem}.so*")))
    return names


@functools.cache
def nvrtc() -> ctypes.CDLL:
    """The NVRTC library (RtcError where none loads)."""
    for name in _candidates("libnvrtc"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RtcError("NVRTC (libnvrtc) was not found: install torch's CUDA build (it ships NVRTC)")


@functools.cache
def driver() -> ctypes.CDLL:
    """The CUDA driver library (RtcError where it does not load)."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise RtcError(f"the CUDA driver library could not be loaded: {exc}") from exc


def _nvrtc_check(lib: ctypes.CDLL, code: int, what: str) -> None:
    if code:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RtcError(f"NVRTC {what}: {lib.nvrtcGetErrorString(code).decode()}")


def _cu_check(code: int, what: str) -> None:
    if code:
        lib = driver()
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(code, ctypes.byref(msg))
        raise RtcError(f"CUDA driver {what}: error {code} ({(msg.value or b'?').decode()})")


def _log(lib: ctypes.CDLL, prog: ctypes.c_void_p) -> str:
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    return log.value.decode(errors="replace")


def compile_kernels(source: str, names: list[str], arch: str, options: tuple[str, ...] = (),
                    log_out: list | None = None) -> tuple[bytes, dict]:
    """Compile `source` for sm_`arch` (e.g. "90") -> (CUBIN, {name expression: lowered symbol}). Templates are
    instantiated by their name expressions (e.g. "k<4, true>"). log_out: the compiler's log (warnings) is appended
    to it."""
    lib = nvrtc()
    prog = ctypes.c_void_p()
    _nvrtc_check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"quantlab.cu", 0, None, None),
                 "create")
    try:
        for name in names:
            _nvrtc_check(lib, lib.nvrtcAddNameExpression(prog, name.encode()), f"name {name}")
        opts = [f"--gpu-architecture=sm_{arch}", "--std=c++17", *options]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        code = lib.nvrtcCompileProgram(prog, len(opts), arr)
        if code:
            raise RtcError(f"NVRTC compile failed:\n{_log(lib, prog)}")
        if log_out is not None:
            log_out.append(_log(lib, prog))
        size = ctypes.c_size_t()
        _nvrtc_check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        _nvrtc_check(lib, lib.nvrtcGetCUBIN(prog, cubin), "cubin")
        lowered = {}
        for name in names:
            sym = ctypes.c_char_p()
            _nvrtc_check(lib, lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(sym)), f"lowered {name}")
            lowered[name] = sym.value.decode()
        return cubin.raw, lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


class Module:
    """A CUBIN loaded on the current CUDA device; `launch(name, grid, block, args)` on torch's current stream."""

    def __init__(self, cubin: bytes, lowered: dict) -> None:
        lib = driver()
        torch.cuda.init()
        torch.cuda.current_blas_handle()  # makes the primary context current on this thread
        self._keep = ctypes.create_string_buffer(cubin, len(cubin))
        self.module = ctypes.c_void_p()
        _cu_check(lib.cuModuleLoadData(ctypes.byref(self.module), self._keep), "module load")
        self.functions = {}
        for name, sym in lowered.items():
            fn = ctypes.c_void_p()
            _cu_check(lib.cuModuleGetFunction(ctypes.byref(fn), self.module, sym.encode()), f"function {name}")
            self.functions[name] = fn

    def allow_shared(self, name: str, nbytes: int) -> None:
        """Let kernel `name` use up to nbytes of dynamic shared memory (above the default 48 KB where the device
        has it)."""
        _cu_check(driver().cuFuncSetAttribute(self.functions[name], 8, ctypes.c_int(nbytes)),  # MAX_DYNAMIC_SHARED
                  f"shared memory of {name}")

    def launch(self, name: str, grid: tuple[int, int, int], block: tuple[int, int, int], args: list,
               shared: int = 0, pdl: bool = False) -> None:
        """args: tensors (their data pointers), Python ints (C int), or ctypes values as they are. pdl: launch as a
        programmatic dependent of the stream's previous kernel (compute capability 9.0 and later): the kernel may
        start before that one ends and must execute `griddepcontrol.wait` before it reads what the previous kernels
        wrote or writes anything (the kernels here read only constant weights before it)."""
        cargs = []
        for a in args:
            if isinstance(a, torch.Tensor):
                cargs.append(ctypes.c_void_p(a.data_ptr()))
            elif isinstance(a, bool | int):
                cargs.append(ctypes.c_int(int(a)))
            else:
                cargs.append(a)
        ptrs = (ctypes.c_void_p * len(cargs))(*[ctypes.cast(ctypes.pointer(c), ctypes.c_void_p) for c in cargs])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        if pdl and not PDL_REFUSED:
            attr = pdl_attribute()
            config = _LaunchConfig(*grid, *block, shared, stream, ctypes.pointer(attr), 1)
            try:
                _cu_check(driver().cuLaunchKernelEx(ctypes.byref(config), self.functions[name], ptrs, None),
                          f"launch {name} (programmatic dependent)")
                return
            except (RtcError, AttributeError) as exc:  # an older driver: the plain launch below, from now on
                PDL_REFUSED.append(str(exc))
                logging.getLogger("quantlab").warning("cuda: %s; kernels are launched without PDL", exc)
        _cu_check(driver().cuLaunchKernel(self.functions[name], *grid, *block, shared, stream, ptrs, None),
                  f"launch {name}")


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID of CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def pdl_attribute() -> _LaunchAttribute:
    """The launch attribute that allows the kernel to start before the stream's previous kernel ends."""
    attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1  # programmaticStreamSerializationAllowed, the union's first int
    return attr


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union (its first int is the flag here)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig of cuLaunchKernelEx."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]
