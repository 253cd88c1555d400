"""Argument checks of the normal mode. NormalBuffer runs them before anything is sent, so a rejected
call changes no state on any rank. They look at types, dtypes, shapes, devices, layouts and Python
values only -- never at tensor values (no .item()/.tolist() on device tensors: that is a device sync
per call, and values are the backend's job: the reference raises, the kernels record). Wrong
Python/torch types and dtypes raise TypeError, everything else ValueError; messages name the argument,
what was expected and what was given."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Tuple

from ..config import MAX_HIDDEN
from ..validate import check_aligned, check_bool
from ..validate import check_tensor as _check_tensor
from .config import MAX_LOCAL_EXPERTS, MAX_TOPK, Config
from .handle import NormalHandle
from .limits import MAX_EXPERT_ALIGNMENT, MAX_TOKENS

if TYPE_CHECKING:
    import torch

HIDDEN_ALIGN = 128   # FP8 scale group; also keeps every row a whole number of 16-byte vectors


def check_int(name: str, value: Any, lo: int, hi: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r:.80})")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
    return value


def check_tensor(name: str, t: Any, *, dtype: "torch.dtype", shape: Any, device: "torch.device",
                 contiguous: bool = True) -> "torch.Tensor":
    """pyep.ep.validate.check_tensor for dense (strided) tensors: a sparse or otherwise non-strided
    tensor is refused here, before its strides or contiguity are asked for (they raise for it)."""
    import torch
    if isinstance(t, torch.Tensor) and t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    return _check_tensor(name, t, dtype=dtype, shape=shape, device=device, contiguous=contiguous)


def check_hidden(name: str, hidden: int, buffer_hidden: Optional[int]) -> int:
    if hidden <= 0 or hidden % HIDDEN_ALIGN or hidden > MAX_HIDDEN:
        raise ValueError(f"{name}: hidden must be a positive multiple of {HIDDEN_ALIGN} and <= {MAX_HIDDEN}, "
                         f"got {hidden}")
    if buffer_hidden is not None and hidden > buffer_hidden:
        raise ValueError(f"{name}: hidden {hidden} is larger than this buffer's hidden={buffer_hidden} "
                         f"(construct the NormalBuffer with hidden >= {hidden})")
    return hidden


def check_num_experts(num_experts: Any, num_ranks: int) -> int:
    check_int("num_experts", num_experts, 1)
    if num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} must be a multiple of the group size {num_ranks}")
    if num_experts // num_ranks > MAX_LOCAL_EXPERTS:
        raise ValueError(f"num_experts={num_experts} gives {num_experts // num_ranks} experts per rank; at "
                         f"most {MAX_LOCAL_EXPERTS} are supported")
    return num_experts


def check_topk_idx(name: str, t: Any, n: Optional[int], device: "torch.device") -> int:
    """int64 [N, K] contiguous with 1 <= K <= 16; returns K."""
    import torch
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must have shape [N, K], got {list(t.shape)}")
    k = int(t.shape[1])
    if not 1 <= k <= MAX_TOPK:
        raise ValueError(f"{name} has K={k} columns; K must be in [1, {MAX_TOPK}]")
    check_tensor(name, t, dtype=torch.int64, shape=(n, k), device=device)
    return k


def check_config(config: Any) -> Optional[Config]:
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a pyep.ep.normal.Config (or None for the defaults), got "
                        f"{type(config).__name__}")
    return config


def check_previous_event(ev: Any) -> None:
    if ev is None:
        return
    from ..backend import CompletedEvent
    from .events import NormalEvent
    if isinstance(ev, (NormalEvent, CompletedEvent)) or hasattr(ev, "event"):
        return   # hasattr: EventOverlap wrappers (pyep.compat, DeepEP-style code)
    import torch
    if torch.cuda.is_available() and isinstance(ev, torch.cuda.Event):
        return
    raise TypeError(f"previous_event must be an event returned by this buffer (or capture()), got "
                    f"{type(ev).__name__}")


def check_stream_flags(previous_event: Any, async_finish: Any, allocate_on_comm_stream: Any) -> None:
    check_bool("async_finish", async_finish)
    check_bool("allocate_on_comm_stream", allocate_on_comm_stream)
    check_previous_event(previous_event)
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        raise ValueError("allocate_on_comm_stream=True requires previous_event and async_finish=True "
                         "(the outputs then belong to the comm stream, which only an event can order)")


def check_handle(handle: Any, *, owner: str, epoch: int, num_ranks: int) -> NormalHandle:
    if not isinstance(handle, NormalHandle):
        raise TypeError(f"handle must be the handle returned by this buffer's dispatch, got "
                        f"{type(handle).__name__}")
    if handle.owner != owner:
        raise ValueError("handle was issued by another NormalBuffer (a buffer only takes the handles of its "
                         "own dispatches)")
    if handle.epoch != epoch:
        raise ValueError(f"handle is stale: it was made before clean() (handle epoch {handle.epoch}, "
                         f"buffer epoch {epoch}); dispatch again to get a new one")
    if handle.rank_prefix_matrix.shape != (num_ranks, num_ranks):
        raise ValueError(f"handle describes {handle.rank_prefix_matrix.shape[0]} ranks, this buffer has "
                         f"{num_ranks}")
    return handle


def check_channels(what: str, config: Config, handle: NormalHandle) -> None:
    # The handle's prefix matrices are per channel: reusing it needs the channel count it was made with.
    if config.num_channels() != handle.num_channels:
        raise ValueError(f"{what}: config has {config.num_channels()} channels (num_sms={config.num_sms}) but the "
                         f"handle was made with {handle.num_channels}; pass a config with "
                         f"num_sms={2 * handle.num_channels} or None")


class DispatchArgs(NamedTuple):   # a NamedTuple: built every call, in half a frozen dataclass's time
    x: "torch.Tensor"
    x_scales: Optional["torch.Tensor"]     # any strides (DeepGEMM's are column-major)
    hidden: int
    num_experts: int                       # 0 for cached dispatch
    num_topk: int                          # 0 without topk_idx


def split_x(x: Any, device: "torch.device") -> Tuple["torch.Tensor", Optional["torch.Tensor"]]:
    """x is bf16 [N, H], or (e4m3 [N, H], fp32 scales [N, H/128]) -- scales may be strided (DeepEP
    and SGLang pass column-major ones); the front makes them contiguous."""
    import torch
    if isinstance(x, tuple):
        if len(x) != 2:
            raise ValueError(f"x as a tuple must be (fp8 data, scales), got {len(x)} elements")
        data, scales = x
        if not isinstance(data, torch.Tensor) or data.dtype != torch.float8_e4m3fn:
            raise TypeError(f"x[0] must be a torch.float8_e4m3fn tensor, got "
                            f"{getattr(data, 'dtype', type(data).__name__)}")
        if data.dim() != 2:
            raise ValueError(f"x[0] must have shape [N, hidden], got {list(data.shape)}")
        check_tensor("x[0]", data, dtype=torch.float8_e4m3fn, shape=(None, None), device=device)
        check_aligned("x[0]", data)
        n, h = int(data.shape[0]), int(data.shape[1])
        check_tensor("x[1] (scales)", scales, dtype=torch.float32, shape=(n, max(h, 0) // HIDDEN_ALIGN),
                     device=device, contiguous=False)
        return data, scales
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a bf16 torch.Tensor or an (fp8, scales) tuple, got {type(x).__name__}")
    if x.dtype == torch.float8_e4m3fn:
        raise TypeError("x is float8_e4m3fn without scales: pass (x, scales) with fp32 scales [N, H/128]")
    if x.dim() != 2:
        raise ValueError(f"x must have shape [N, hidden], got {list(x.shape)}")
    check_tensor("x", x, dtype=torch.bfloat16, shape=(None, None), device=device)
    check_aligned("x", x)
    return x, None


def validate_layout(topk_idx: Any, num_experts: Any, num_ranks: int, device: "torch.device") -> None:
    check_topk_idx("topk_idx", topk_idx, None, device)
    if int(topk_idx.shape[0]) > MAX_TOKENS:
        raise ValueError(f"topk_idx has {int(topk_idx.shape[0])} tokens; at most {MAX_TOKENS} are supported")
    check_num_experts(num_experts, num_ranks)


def validate_dispatch(*, x: Any, handle: Any, num_tokens_per_rank: Any, num_tokens_per_rdma_rank: Any,
                      is_token_in_rank: Any, num_tokens_per_expert: Any, topk_idx: Any, topk_weights: Any,
                      expert_alignment: Any, num_worst_tokens: Any, num_ranks: int,
                      device: "torch.device", buffer_hidden: int, owner: str, epoch: int,
                      num_nodes: int = 1) -> DispatchArgs:
    """Checks a dispatch call (cached when handle is given); num_nodes > 1: internode."""
    import torch
    data, scales = split_x(x, device)
    n, h = int(data.shape[0]), int(data.shape[1])
    check_hidden("x", h, buffer_hidden)
    if n > MAX_TOKENS:
        raise ValueError(f"x has {n} tokens; at most {MAX_TOKENS} are supported")
    check_int("expert_alignment", expert_alignment, 1, MAX_EXPERT_ALIGNMENT)
    check_int("num_worst_tokens", num_worst_tokens, 0, MAX_TOKENS)
    if num_tokens_per_rdma_rank is not None and num_nodes == 1:
        raise ValueError("num_tokens_per_rdma_rank must be None: this buffer is intranode (get_dispatch_layout "
                         "returns None for it)")
    if handle is not None:
        hd = check_handle(handle, owner=owner, epoch=epoch, num_ranks=num_ranks)
        given = [name for name, v in (("topk_idx", topk_idx), ("topk_weights", topk_weights),
                                      ("num_tokens_per_rank", num_tokens_per_rank),
                                      ("num_tokens_per_expert", num_tokens_per_expert),
                                      ("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank),
                                      ("is_token_in_rank", is_token_in_rank)) if v is not None]
        if given:
            raise ValueError(f"cached dispatch (handle given) takes the routing from the handle: pass "
                             f"{', '.join(given)} as None")
        if n != hd.num_tokens:
            raise ValueError(f"x has {n} tokens but the handle was made for {hd.num_tokens}")
        if num_worst_tokens not in (0, hd.num_worst_tokens):
            raise ValueError(f"cached dispatch: num_worst_tokens={num_worst_tokens} differs from the handle's "
                             f"{hd.num_worst_tokens} (the received rows are laid out as the handle says)")
        return DispatchArgs(data, scales, h, 0, 0)
    needed = [("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
              ("num_tokens_per_expert", num_tokens_per_expert)]
    if num_nodes > 1:
        needed.append(("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank))
    missing = [name for name, v in needed if v is None]
    if missing:
        raise ValueError(f"dispatch without a handle needs the layout from get_dispatch_layout: "
                         f"{', '.join(missing)} is None")
    check_tensor("num_tokens_per_rank", num_tokens_per_rank, dtype=torch.int32, shape=(num_ranks,), device=device)
    if num_nodes > 1:
        check_tensor("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, dtype=torch.int32, shape=(num_nodes,),
                     device=device)
    check_tensor("is_token_in_rank", is_token_in_rank, dtype=torch.bool, shape=(n, num_ranks), device=device)
    if not isinstance(num_tokens_per_expert, torch.Tensor) or num_tokens_per_expert.dim() != 1:
        raise (TypeError if not isinstance(num_tokens_per_expert, torch.Tensor) else ValueError)(
            f"num_tokens_per_expert must be an int32 tensor [num_experts], got "
            f"{getattr(num_tokens_per_expert, 'shape', type(num_tokens_per_expert).__name__)}")
    e = check_num_experts(int(num_tokens_per_expert.shape[0]), num_ranks)
    check_tensor("num_tokens_per_expert", num_tokens_per_expert, dtype=torch.int32, shape=(e,), device=device)
    if (topk_idx is None) != (topk_weights is None):
        raise ValueError("topk_idx and topk_weights go together: pass both or neither")
    k = 0
    if topk_idx is not None:
        k = check_topk_idx("topk_idx", topk_idx, n, device)
        check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(n, k), device=device)
    if num_worst_tokens > 0 and topk_idx is None:
        raise ValueError("num_worst_tokens > 0 needs topk_idx/topk_weights (the padding rows are marked by "
                         "recv_topk_idx = -1)")
    return DispatchArgs(data, scales, h, e, k)


def validate_combine(*, x: Any, handle: NormalHandle, topk_weights: Any, bias: Any, device: "torch.device",
                     buffer_hidden: int) -> Tuple[Optional["torch.Tensor"], Optional["torch.Tensor"]]:
    """Checks a combine call whose handle was checked already; returns (bias_0, bias_1)."""
    import torch
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a bf16 torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must have shape [{handle.num_recv_rows}, hidden], got {list(x.shape)}")
    h = int(x.shape[1])
    check_tensor("x", x, dtype=torch.bfloat16, shape=(handle.num_recv_rows, h), device=device)
    check_aligned("x", x)
    check_hidden("x", h, buffer_hidden)
    if topk_weights is not None:
        if not isinstance(topk_weights, torch.Tensor) or topk_weights.dim() != 2:
            raise (TypeError if not isinstance(topk_weights, torch.Tensor) else ValueError)(
                f"topk_weights must be an fp32 tensor [{handle.num_recv_rows}, K], got "
                f"{getattr(topk_weights, 'shape', type(topk_weights).__name__)}")
        k = int(topk_weights.shape[1])
        if not 1 <= k <= MAX_TOPK:
            raise ValueError(f"topk_weights has K={k} columns; K must be in [1, {MAX_TOPK}]")
        check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(handle.num_recv_rows, k),
                     device=device)
    if bias is None:
        pair: Tuple[Any, Any] = (None, None)
    elif isinstance(bias, torch.Tensor):
        pair = (bias, None)
    elif isinstance(bias, tuple) and len(bias) == 2:
        pair = bias
    else:
        raise TypeError(f"bias must be None, a bf16 tensor or a pair of them, got {type(bias).__name__}")
    for i, b in enumerate(pair):
        if b is not None:
            check_tensor(f"bias[{i}]", b, dtype=torch.bfloat16, shape=(handle.num_tokens, h), device=device)
            check_aligned(f"bias[{i}]", b)
    return pair[0], pair[1]
