"""ConvBERT building blocks, named exactly as transformers names them.

Module and parameter names match ``transformers.ConvBertModel`` one to one, so
a transformers state dict loads without any renaming. The computation is the
same function, written for speed: self-attention goes through
``scaled_dot_product_attention`` and the dynamic convolution through
``convbert_ds.model.sdconv`` (no K-times unfold copy).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from convbert_ds.config import ModelConfig
from convbert_ds.model.depthwise import document_depthwise_conv, probe_document_conv
from convbert_ds.model.sdconv import dynamic_conv, probe_sdconv, same_segment_taps

ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),  # config.hidden_act -> function
               "relu": F.relu, "silu": F.silu, "tanh": torch.tanh}


class PaddingMasks(NamedTuple):
    """A body's masks in the forms its layers use, built once per forward, not once per layer.

    With ``documents`` (packed samples: several documents per row), every token sees only its own document:
    attention is block-diagonal and both convolutions restart at each boundary, so a document's outputs are
    what it gives alone (``tests/model/test_packed_documents.py``).
    """

    tokens: torch.Tensor  # [B, T], 1 = token, 0 = padding (the SDConv value mask)
    attention: torch.Tensor  # scaled_dot_product_attention's bool mask: [B, 1, 1, T], or [B, 1, T, T] packed
    documents: torch.Tensor | None = None  # [B, T] document ids (0 = padding), packed samples only
    conv_taps: torch.Tensor | None = None  # [B, T, K] 1 = conv tap inside the token's document, packed only


def padding_masks(attention_mask: torch.Tensor | PaddingMasks | None, document_ids: torch.Tensor | None = None,
                  kernel_size: int = 1) -> PaddingMasks | None:
    if isinstance(attention_mask, PaddingMasks):
        return attention_mask
    if document_ids is None:
        return None if attention_mask is None else PaddingMasks(attention_mask, attention_mask[:, None, None, :].bool())
    tokens = (document_ids > 0).long() if attention_mask is None else attention_mask
    # Padding (id 0) sees padding only, so no row of the attention is empty (an all-masked row gives NaN).
    same_document = document_ids[:, None, :, None] == document_ids[:, None, None, :]
    return PaddingMasks(tokens, same_document, document_ids, same_segment_taps(document_ids, kernel_size))


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` position ids that restart at 0 where each document starts (and where padding starts)."""
    index = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


class ResidualLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters and names) whose output, under ``torch.autocast`` and with
    ``ModelConfig.residual_dtype="autocast"``, is in autocast's dtype. CUDA's autocast runs LayerNorm in fp32
    and returns fp32 (CPU's keeps an fp32 input's dtype), so every residual add, dropout and LayerNorm
    backward between layers would read and write 4 bytes an element where the matmuls around them take 2.
    The norm's statistics are still computed in fp32; only what it writes is narrower. Outside autocast it
    is ``nn.LayerNorm``. Every LayerNorm of the model is one, the generator head's too (its output feeds only
    the tied decoder's matmul, which reads bf16 under autocast either way)."""

    def __init__(self, width: int, config: ModelConfig):
        super().__init__(width, eps=config.layer_norm_eps)
        self.to_autocast_dtype = config.residual_dtype == "autocast"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        device = out.device.type
        if self.to_autocast_dtype and torch.is_autocast_enabled(device):
            return out.to(torch.get_autocast_dtype(device))
        return out


class ConvBertEmbeddings(nn.Module):
    """Word + position + token-type embeddings, LayerNorm, dropout (width ``embedding_size``)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.embedding_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.embedding_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.embedding_size)
        self.LayerNorm = ResidualLayerNorm(config.embedding_size, config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        embeddings = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        embeddings = embeddings + (self.token_type_embeddings.weight[0] if token_type_ids is None
                                   else self.token_type_embeddings(token_type_ids))
        return self.dropout(self.LayerNorm(embeddings))


class SeparableConv1D(nn.Module):
    """Depthwise conv over time (``same`` padding) then a pointwise projection, one shared bias."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__()
        self.depthwise = nn.Conv1d(in_channels, in_channels, kernel_size, groups=in_channels,
                                   padding=kernel_size // 2, bias=False)
        self.pointwise = nn.Conv1d(in_channels, out_channels, kernel_size=1, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_channels, 1))

    @torch.no_grad()
    def reset(self, std: float) -> None:
        """The official code's initialisation (yitu-opensource/ConvBert, ``conv_attn_key``): truncated normals
        cut at two standard deviations (TensorFlow's ``truncated_normal_initializer``): the K depthwise taps
        with std 1/K (9: 0.111, so the window's output starts with 1/K of its input's variance), the pointwise
        projection with ``std`` (0.02); bias zero. transformers draws both from a normal with std 0.02."""
        taps = 1.0 / self.depthwise.kernel_size[0]
        nn.init.trunc_normal_(self.depthwise.weight, 0.0, taps, -2 * taps, 2 * taps)
        nn.init.trunc_normal_(self.pointwise.weight, 0.0, std, -2 * std, 2 * std)
        self.bias.zero_()

    def forward(self, x: torch.Tensor, taps: torch.Tensor | None = None, impl: str = "torch") -> torch.Tensor:
        """``x``: ``[B, T, C_in]`` -> ``[B, T, C_out]``; ``taps`` ``[B, T, K]``: 0 where a tap must read zero
        (it lies in another document than its output position); ``impl``: the packed conv's (``sdconv_impl``)."""
        if taps is None:
            return (self.pointwise(self.depthwise(x.transpose(1, 2))) + self.bias).transpose(1, 2)
        # Packed documents: the taps depend on the position, which conv1d cannot mask.
        mixed = document_depthwise_conv(x, self.depthwise.weight[:, 0, :], taps, impl)
        return F.linear(mixed, self.pointwise.weight[:, :, 0]) + self.bias[:, 0]


class ConvBertSelfAttention(nn.Module):
    """Mixed attention: ``n`` self-attention heads and ``n`` conv heads sharing the query.

    Output: ``cat([self_attention_heads, conv_heads], -1)``, width ``2A``
    (``A`` without conv heads).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        hidden, width = config.hidden_size, config.attention_width
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.kernel_size = config.conv_kernel_size
        self.dropout_p = config.attention_probs_dropout_prob
        self.query = nn.Linear(hidden, width)
        self.key = nn.Linear(hidden, width)
        self.value = nn.Linear(hidden, width)
        if config.conv_type in ("sdconv", "conventional"):
            self.key_conv_attn_layer = SeparableConv1D(hidden, width, config.conv_kernel_size)
        if config.conv_type in ("sdconv", "dynamic"):
            self.conv_kernel_layer = nn.Linear(width, self.num_heads * self.kernel_size)
            self.conv_out_layer = nn.Linear(hidden, width)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        return x.view(batch, seq_len, self.num_heads, self.head_dim)

    def _input_projections(self, hidden_states: torch.Tensor) -> list[torch.Tensor]:
        """``[query, key, value]``, and the conv heads' values (``conv_out_layer``) where there are conv heads:
        the projections that read the layer's input, as one matmul over their weights stacked.

        One wide GEMM instead of three or four narrow ones (N = 4A instead of A), one cast of the stacked
        weight under autocast instead of one per weight, and in the backward one GEMM for the input's
        gradient instead of four and their sum. The parameters stay the four ``nn.Linear``s transformers
        names, so checkpoints do not change. ZeRO-3 gathers weights read without their module's call on
        access (its parameter getter registers them as this module's external parameters)."""
        projections = [self.query, self.key, self.value]
        if hasattr(self, "conv_out_layer"):
            projections.append(self.conv_out_layer)
        weight = torch.cat([p.weight for p in projections])
        bias = torch.cat([p.bias for p in projections])
        return list(F.linear(hidden_states, weight, bias).split(self.query.out_features, dim=-1))

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | PaddingMasks | None = None
                ) -> torch.Tensor:
        """``hidden_states`` ``[B, T, H]``; ``attention_mask`` ``[B, T]`` (1 = token, 0 = padding), its
        ``PaddingMasks``, or None."""
        batch, seq_len, _ = hidden_states.shape
        query, key, value, *conv_values = self._input_projections(hidden_states)
        masks = padding_masks(attention_mask)
        sdpa_mask = None if masks is None else masks.attention
        context = F.scaled_dot_product_attention(
            self._heads(query).transpose(1, 2), self._heads(key).transpose(1, 2),
            self._heads(value).transpose(1, 2), attn_mask=sdpa_mask,
            dropout_p=self.dropout_p if self.training else 0.0).transpose(1, 2).reshape(batch, seq_len, -1)
        conv_type = self.config.conv_type
        if conv_type == "none":
            return context
        if conv_type == "conventional":
            conv = self.key_conv_attn_layer(hidden_states, None if masks is None else masks.conv_taps,
                                            self.config.sdconv_impl)
        else:
            # The unscaled query gates the span-aware key (sdconv) or alone makes the kernel (dynamic).
            taps = None if masks is None else masks.conv_taps
            kernel_input = (query * self.key_conv_attn_layer(hidden_states, taps, self.config.sdconv_impl)
                            if conv_type == "sdconv" else query)
            kernel_logits = self.conv_kernel_layer(kernel_input).view(batch, seq_len, self.num_heads,
                                                                      self.kernel_size)
            value_mask = masks.tokens if self.config.sdconv_mask_padding and masks is not None else None
            conv = dynamic_conv(kernel_logits, self._heads(conv_values[0]), value_mask,
                                impl=self.config.sdconv_impl, segments=None if masks is None else masks.documents
                                ).reshape(batch, seq_len, -1)
        return torch.cat([context, conv], dim=-1)


class ConvBertSelfOutput(nn.Module):
    """Dense, dropout, residual, LayerNorm; ``dense`` None: the projection of the mixed attention's output."""

    def __init__(self, config: ModelConfig, dense: nn.Module | None = None):
        super().__init__()
        in_width = config.attention_width * (2 if config.has_conv else 1)
        self.dense = nn.Linear(in_width, config.hidden_size) if dense is None else dense
        self.LayerNorm = ResidualLayerNorm(config.hidden_size, config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + residual)


class ConvBertAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self = ConvBertSelfAttention(config)
        self.output = ConvBertSelfOutput(config)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | PaddingMasks | None = None
                ) -> torch.Tensor:
        return self.output(self.self(hidden_states, attention_mask), hidden_states)


class GroupedLinear(nn.Module):
    """The paper's grouped linear operator: ``num_groups`` independent linears over channel slices.

    Weight layout ``[G, in/G, out/G]`` (input-major) and one bias ``[out]``, as in transformers.
    """

    def __init__(self, in_features: int, out_features: int, num_groups: int):
        super().__init__()
        self.num_groups = num_groups
        self.weight = nn.Parameter(torch.empty(num_groups, in_features // num_groups, out_features // num_groups))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        grouped = x.reshape(-1, self.num_groups, self.weight.shape[1]).transpose(0, 1)  # [G, N, in/G]
        out = torch.bmm(grouped, self.weight).transpose(0, 1)  # [N, G, out/G]
        return out.reshape(*leading, -1) + self.bias


def _ffn_linear(in_features: int, out_features: int, num_groups: int) -> nn.Module:
    if num_groups == 1:
        return nn.Linear(in_features, out_features)
    return GroupedLinear(in_features, out_features, num_groups)


class ConvBertIntermediate(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dense = _ffn_linear(config.hidden_size, config.intermediate_size, config.num_groups)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(hidden_states))


class ConvBertOutput(ConvBertSelfOutput):
    def __init__(self, config: ModelConfig):
        super().__init__(config, _ffn_linear(config.intermediate_size, config.hidden_size, config.num_groups))


class ConvBertLayer(nn.Module):
    """One transformer block: mixed attention, then the (grouped) feed-forward, post-LayerNorm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention = ConvBertAttention(config)
        self.intermediate = ConvBertIntermediate(config)
        self.output = ConvBertOutput(config)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | PaddingMasks | None = None
                ) -> torch.Tensor:
        attention_output = self.attention(hidden_states, attention_mask)
        return self.output(self.intermediate(attention_output), attention_output)


@torch.compiler.nested_compile_region
def run_layer_compiled_once(layer: ConvBertLayer, hidden_states: torch.Tensor,
                            masks: PaddingMasks | None) -> torch.Tensor:
    """``layer(hidden_states, masks)``, marked for ``torch.compile`` as a region whose code is built once and
    reused by every layer of the same width (``compile_step(layers_once=True)``); eager, a plain call."""
    return layer(hidden_states, masks)


@torch.no_grad()
def init_weights(module: nn.Module, std: float) -> None:
    """BERT's initialisation as transformers applies it to ConvBERT (normal, ``std``), except the span-aware
    key's separable convolution, initialised as the official code does (``SeparableConv1D.reset``)."""
    if isinstance(module, (nn.Linear, GroupedLinear)):
        module.weight.normal_(0.0, std)
        if module.bias is not None:
            module.bias.zero_()
    elif isinstance(module, nn.Embedding):
        module.weight.normal_(0.0, std)
        if module.padding_idx is not None:
            module.weight[module.padding_idx].zero_()
    elif isinstance(module, nn.LayerNorm):
        module.weight.fill_(1.0)
        module.bias.zero_()
    elif isinstance(module, SeparableConv1D):
        module.reset(std)


def compile_layers(model: nn.Module, eager_random: bool = True, options: dict | None = None) -> int:
    """Put every ``ConvBertLayer`` of ``model`` through ``torch.compile`` (inductor), in place; returns how many.

    The layer is the unit because it is where the fusable work is (GELU, LayerNorm, bias adds, softmax
    and the SDConv shifts around the GEMMs) and because it is the same class in the plain model and in
    the pipeline stages. Layers of one shape share one graph (ELECTRA has two: the generator's and the
    discriminator's width); ``nn.Module.compile`` keeps parameter names, so checkpoints do not change.
    Masking, Gumbel sampling and the losses stay eager: their data-dependent shapes (the masked
    positions) would recompile or break the graph every step. Shapes are static: batches are fixed-size.
    ``eager_random`` and ``options``: as for ``compile_step``.
    """
    layers = [module for module in model.modules() if isinstance(module, ConvBertLayer)]
    options = {**cpu_wrapper(), **_random_stream(eager_random), **(options or {})}
    for layer in layers:
        layer.compile(dynamic=False, options=options)
    return len(layers)


def cpu_wrapper(layers_once: bool = False) -> dict:
    """Inductor's C++ wrapper for what it compiles to C++ kernels (no GPU, its default CPU backend): a graph's
    kernels and the code that calls them go to g++ as one file, where the Python wrapper has g++ build each
    kernel apart. On CPU a step compiles in much less time, a restart that loads the compile cache file even
    more so (the file holds each graph's built library; the Python wrapper's kernels are built again), and
    the compiled step runs no slower (benchmarks/RESULTS.md#row-cpp-wrapper).
    ``train.compile_options.cpp_wrapper=false`` turns it off. Not with ``layers_once``: torch 2.13's C++
    wrapper cannot call a region compiled once (``invoke_subgraph``)."""
    import torch._inductor.config as inductor_config

    if torch.cuda.is_available() or layers_once or inductor_config.cpu_backend != "cpp":
        return {}
    return {"cpp_wrapper": True}


def probe_triton_kernels(model: nn.Module, device: torch.device | str, dtype: torch.dtype) -> dict[tuple, str | None]:
    """Probe, eagerly, every Triton kernel that ``sdconv_impl: auto`` sends ``model``'s layers to on ``device``:
    SDConv (``probe_sdconv``, its conv heads computing in ``dtype``) and the depthwise conv over packed
    documents (``probe_document_conv``). Call it before ``torch.compile`` or a capture, which cannot run the
    probes inside. Returns every probed key and why its kernels are not used (None: they are)."""
    return {**probe_sdconv(model, device, dtype), **probe_document_conv(model, device)}


# train.compile_autotune's levels, as formats/train_config.py declares them (which imports no torch).
AutotuneLevel = Literal[False, "kernels", "matmuls", True]


def compile_step(model: nn.Module, cuda_graphs: bool, layers_once: bool = False,
                 autotune: AutotuneLevel = False, eager_random: bool = True,
                 options: dict | None = None) -> None:
    """Put the whole forward of ``model`` (the ELECTRA step: masking, both bodies, sampling, losses) through
    ``torch.compile`` as one graph, in place: ``fullgraph=True``, so a graph break is an error, not a silent
    return of the host to the loop; its backward is compiled with it (AOTAutograd). ``cuda_graphs`` (on CUDA
    only) asks inductor for its CUDA-graph trees (``mode="reduce-overhead"``): one launch instead of
    thousands, where inductor captures them (``cuda_graphs_recorded`` says whether it did); without it the
    kernels launch one by one, or ``step_capture`` captures them. The step may take this shape because
    nothing in it reads the device (static masking, no ``.item()``, inputs checked on the host) and batches
    have one shape. Call it with ``check=False``. Only training calls run the graph; evaluation runs eager
    (``TrainingStepCompiled``).

    ``layers_once``: trace and compile one encoder layer per width (ELECTRA has two: the generator's and the
    discriminator's) and call that code for every layer, instead of unrolling 2 x 12 layers into the graph
    (torch's nested compile regions): the first step's compile takes a fraction of the time (a CPU ratio:
    ``benchmarks/compile_time.py``), fusion across a layer's edges is what is given up. Inductor's buffer
    reuse is turned off for it: with it, torch 2.13 corrupted the gradients of a reused region (the
    discriminator's last layer's input projections came back about 100% off, the loss right;
    ``tests/model/test_compile_layers_once.py``), and freed buffers return to torch's caching allocator
    anyway.

    ``autotune`` (Triton's kernels only: nothing changes on CPU): on a GPU the step's time is in its matmuls
    and in the fused elementwise kernels around them (benchmarks/RESULTS.md#row-base-paper-path). ``"kernels"``
    times several block sizes for each fused elementwise and reduction kernel at its first call, then refines
    the best by coordinate descent: those kernels move bytes, and the heuristic's block sizes left the GELUs
    short of the GPU's memory bandwidth. ``"matmuls"`` times Triton matmul templates against cuBLAS instead, at
    compile time: a template can take the elementwise kernel after its matmul in as its epilogue (the FFN's
    GELU: its separate kernels read and write the 3,072-wide activation; an epilogue saves part of that).
    ``True``, inductor's max-autotune, does both: the most minutes of compiling.

    ``eager_random`` (the default): dropout, masking and Gumbel noise draw from torch's own generator, as in
    eager: the same draws, so a compiled run follows the eager one (to rounding), and switching compile on
    or off at a resume keeps the random stream. Each dropout is then a kernel of its own (aten's), between
    inductor's fused kernels. Off, inductor draws them inside its fused kernels: its own Philox stream,
    seeded from torch's generator (the same generator state, the same draws), other draws than eager's.

    ``options``: more of inductor's options (``train.compile_options``, checked by the plan: none of those
    the other arguments set), for what a GPU lease A/Bs without a change of code (``combo_kernels``...)."""
    for body in model.modules():
        if hasattr(body, "layers_compiled_once"):
            body.layers_compiled_once = layers_once
    options = {**cpu_wrapper(layers_once), **step_inductor_options(cuda_graphs, layers_once, autotune, eager_random),
               **(options or {})}
    # ``forward``, not the module's call: hooks that an engine registers on the module (DeepSpeed's timers
    # and ZeRO bookkeeping) stay eager around the graph instead of breaking it.
    model.forward = TrainingStepCompiled(model, torch.compile(model.forward, fullgraph=True, dynamic=False,
                                                              options=options))


class TrainingStepCompiled:
    """Stands in for ``model.forward`` after ``compile_step``: a training call (train mode, gradients on) runs
    the compiled step, any other call (evaluation: eval mode, no grad) the eager forward. Evaluation is a few
    forward-only batches every ``eval.interval`` steps; compiling its graph as well was a second compile at the
    first evaluation of every run and resume (a sizeable fraction of the step's own compile on CPU), and on a
    GPU more graphs to capture and hold. Eager, it draws
    its masks from torch's generator, as a compiled evaluation did unless ``train.compile_random: inductor``,
    and computes the same figures to rounding."""

    def __init__(self, model: nn.Module, compiled):
        self.model, self.compiled, self.eager = model, compiled, model.forward

    def __call__(self, *args, **kwargs):
        return (self.compiled if is_training_call(self.model) else self.eager)(*args, **kwargs)


def is_training_call(model: nn.Module) -> bool:
    """Whether a call of ``model`` now is a training step's (train mode, gradients on): the calls that
    ``compile_step`` and ``capture_step`` stand in for. Any other call (evaluation: eval mode, no grad) they
    hand to the forward they wrap."""
    return model.training and torch.is_grad_enabled()


def step_inductor_options(cuda_graphs: bool, layers_once: bool, autotune: AutotuneLevel,
                          eager_random: bool) -> dict:
    """Inductor's options for ``compile_step``, whose arguments these are."""
    options = {"triton.cudagraphs": cuda_graphs,  # what mode="reduce-overhead" sets, which options cannot join
               **_random_stream(eager_random)}
    if layers_once:
        options["allow_buffer_reuse"] = False
    if autotune in ("kernels", True):
        options.update({"max_autotune_pointwise": True, "coordinate_descent_tuning": True})
    if autotune == "matmuls":
        options["max_autotune_gemm"] = True  # the matmul templates alone
    if autotune is True:
        options["max_autotune"] = True  # the matmul templates too
    return options


def _random_stream(eager: bool) -> dict:
    """Inductor's options for the random draws inside a compiled graph (``compile_step``'s ``eager_random``),
    per compiled function: inductor's global config stays as it is."""
    return {"fallback_random": eager}


def compiled_graph_count() -> int:
    """Graphs torch.compile has built in this process so far (constant once a run has warmed up)."""
    from torch._dynamo.utils import counters  # private but stable since 2.0; the only count torch keeps
    return int(counters["stats"]["unique_graphs"])


def cuda_graphs_recorded() -> int:
    """CUDA graphs that ``compile_step``'s ``reduce-overhead`` mode has recorded so far on the current CUDA
    device (0 without CUDA). A compiled step records one for its forward and one for its backward on its
    second call; still 0 after that means the compiled step launches its kernels one by one. Inductor can
    decide so without a word: with graph partitioning (its default) a graph it will not capture is neither
    logged nor counted as a skip (``cudagraph_skips`` below counts the other cases)."""
    if not torch.cuda.is_available():
        return 0
    from torch._inductor import cudagraph_trees  # private; the trees are the only record of what was captured

    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    if manager is None:
        return 0
    return sum(1 + node.num_descendants() for nodes in manager.roots.values() for node in nodes)


def cudagraph_skips() -> int:
    """Graphs inductor declined to capture and said so (``TORCH_LOGS=cudagraphs`` prints each reason)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])
