"""Built-in models: plain ``nn.Sequential`` stacks with random weights and batch helpers.

Every builder returns a :class:`BuiltinModel`: the module, a ``make_batch(n)`` helper that
returns ``(inputs, targets)`` with ``n`` samples, and the loss to use (mean-reduced, so a
pipelined step that averages micro-batch losses by their share equals the full batch).

* ``mlp``    -- Linear+ReLU blocks of one width: uniform layers, the simulator's easy case.
* ``resnet`` -- a stem conv, residual blocks (the residual stays inside a block), pooling
  and a linear head: layers of very different cost.
* ``gpt``    -- token+position embedding, N pre-norm transformer blocks, final norm, head:
  the first and last layers are deliberately unlike the middle ones (the head is a
  vocabulary-sized matmul).
* ``unet``   -- encoder/decoder with skip connections (``executor.skip`` Stash/Pop layers).
* ``resnet_skip`` -- residual blocks spread over layers, so residuals can cross stages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class BuiltinModel:
    """A model with the means to feed it: ``make_batch(n, seed) -> (inputs, targets)``."""

    name: str
    module: nn.Sequential
    make_batch: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    sizes: dict[str, Any] = field(default_factory=dict)



def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------ MLP
class LinearReLU(nn.Sequential):
    """One MLP layer: Linear then ReLU (ReLU saves its output, Linear its input)."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__(nn.Linear(d_in, d_out), nn.ReLU())


def mlp(width: int = 512, depth: int = 8, in_features: int = 256, classes: int = 10,
        dropout: float = 0.0, seed: int = 0) -> BuiltinModel:
    """``depth`` Linear+ReLU layers of ``width`` units and a linear classifier."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [LinearReLU(in_features, width)]
    for _ in range(depth - 1):
        layers.append(LinearReLU(width, width))
        if dropout:
            layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(width, classes))
    module = nn.Sequential(*layers)

    def make_batch(n: int, seed: int = 0, dtype: torch.dtype = torch.float32):
        g = _generator(seed)
        return (torch.randn(n, in_features, generator=g).to(dtype),
                torch.randint(0, classes, (n,), generator=g))

    return BuiltinModel("mlp", module, make_batch, nn.functional.cross_entropy,
                        dict(width=width, depth=depth, in_features=in_features, classes=classes))


# --------------------------------------------------------------------------- ResNet
def image_classification_batch(image_size: int, classes: int) -> Callable[..., tuple]:
    """``make_batch(n, seed, dtype)``: random RGB images and class labels."""

    def make_batch(n: int, seed: int = 0, dtype: torch.dtype = torch.float32):
        g = _generator(seed)
        return (torch.randn(n, 3, image_size, image_size, generator=g).to(dtype),
                torch.randint(0, classes, (n,), generator=g))

    return make_batch


class BasicBlock(nn.Module):
    """Two 3x3 convs with batch norm; the residual is added inside the block."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                          nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + self.shortcut(x))


def resnet(width: int = 16, blocks: tuple[int, ...] = (2, 2, 2), image_size: int = 32,
           classes: int = 10, seed: int = 0) -> BuiltinModel:
    """A small ResNet: stem, ``blocks[i]`` blocks per stage (width doubles, stride 2), head."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False),
                                             nn.BatchNorm2d(width), nn.ReLU())]
    c = width
    for i, n in enumerate(blocks):
        c_out = width * 2**i
        for j in range(n):
            layers.append(BasicBlock(c, c_out, stride=2 if (i > 0 and j == 0) else 1))
            c = c_out
    layers.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes)))
    module = nn.Sequential(*layers)
    make_batch = image_classification_batch(image_size, classes)
    return BuiltinModel("resnet", module, make_batch, nn.functional.cross_entropy,
                        dict(width=width, blocks=list(blocks), image_size=image_size))


# ------------------------------------------------------------------------------ GPT
class Embedding(nn.Module):
    """Token plus learned position embedding: [batch, seq] ids -> [batch, seq, d]."""

    def __init__(self, vocab: int, d_model: int, seq_len: int, dropout: float):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        self.drop = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.tokens(ids) + self.positions[: ids.shape[1]])


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, each with its residual."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)
        self.p = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        a = nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.norm2(x)))


class Head(nn.Module):
    """Final layer norm and the vocabulary projection: [b, t, d] -> [b, t, vocab] logits."""

    def __init__(self, d_model: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token: logits [b, t, vocab], targets [b, t]."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt(vocab: int = 4096, d_model: int = 128, n_layers: int = 4, n_heads: int = 4,
        seq_len: int = 64, dropout: float = 0.0, seed: int = 0) -> BuiltinModel:
    """A GPT-style decoder as ``[Embedding, Block x n_layers, Head]``.

    Inputs and targets are ``[batch, seq]`` token ids, so both split alike into micro-batches.
    """
    torch.manual_seed(seed)
    module = nn.Sequential(Embedding(vocab, d_model, seq_len, dropout),
                           *[Block(d_model, n_heads, dropout) for _ in range(n_layers)],
                           Head(d_model, vocab))

    def make_batch(n: int, seed: int = 0, dtype: torch.dtype = torch.float32):
        del dtype  # token ids are integers whatever the model's dtype
        g = _generator(seed)
        ids = torch.randint(0, vocab, (n, seq_len + 1), generator=g)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    return BuiltinModel("gpt", module, make_batch, token_cross_entropy,
                        dict(vocab=vocab, d_model=d_model, n_layers=n_layers,
                             n_heads=n_heads, seq_len=seq_len))


# ----------------------------------------------------------------------- skip models
def conv_block(c_in: int, c_out: int) -> nn.Sequential:
    """3x3 convolution, batch norm, ReLU."""
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out),
                         nn.ReLU())


def unet(depth: int = 2, width: int = 8, in_channels: int = 3, classes: int = 2,
         image_size: int = 32, seed: int = 0) -> BuiltinModel:
    """A U-Net as an ``nn.Sequential``: every encoder level stashes its features, the
    decoder level of the same resolution pops and concatenates them (skip connections).

    Layers: stem, ``depth`` x [Stash, down], bottleneck, ``depth`` x [up, Pop, block], head.
    Targets are per-pixel classes ``[batch, H, W]``; ``image_size`` must divide by 2**depth.
    """
    from executor.skip import Pop, Stash

    if image_size % 2**depth:
        raise ValueError(f"image_size {image_size} must be divisible by 2**depth = {2**depth}")
    torch.manual_seed(seed)
    layers: list[nn.Module] = [conv_block(in_channels, width)]
    c = width
    for i in range(depth):
        layers += [Stash(f"level{i}"), nn.Sequential(nn.MaxPool2d(2), conv_block(c, 2 * c))]
        c *= 2
    layers.append(conv_block(c, c))
    for i in reversed(range(depth)):
        layers += [nn.Sequential(nn.Upsample(scale_factor=2), nn.Conv2d(c, c // 2, 1)),
                   Pop(f"level{i}", "cat"), conv_block(c, c // 2)]
        c //= 2
    layers.append(nn.Conv2d(c, classes, 1))
    module = nn.Sequential(*layers)

    def make_batch(n: int, seed: int = 0, dtype: torch.dtype = torch.float32):
        g = _generator(seed)
        return (torch.randn(n, in_channels, image_size, image_size, generator=g).to(dtype),
                torch.randint(0, classes, (n, image_size, image_size), generator=g))

    return BuiltinModel("unet", module, make_batch, nn.functional.cross_entropy,
                        dict(depth=depth, width=width, image_size=image_size, classes=classes))


def resnet_skip(width: int = 16, blocks: int = 4, image_size: int = 16, classes: int = 10,
                seed: int = 0) -> BuiltinModel:
    """A ResNet whose residual blocks are spread over several layers, so a stage boundary
    can fall inside a block and the residual crosses it: per block
    ``[Stash, conv-bn-relu, conv-bn, Pop(add), ReLU]``."""
    from executor.skip import Pop, Stash

    torch.manual_seed(seed)
    layers: list[nn.Module] = [conv_block(3, width)]
    for i in range(blocks):
        layers += [Stash(f"res{i}"), conv_block(width, width),
                   nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False),
                                 nn.BatchNorm2d(width)),
                   Pop(f"res{i}", "add"), nn.ReLU()]
    layers.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes)))
    module = nn.Sequential(*layers)
    make_batch = image_classification_batch(image_size, classes)
    return BuiltinModel("resnet_skip", module, make_batch, nn.functional.cross_entropy,
                        dict(width=width, blocks=blocks, image_size=image_size))


#: name -> builder; every builder takes keyword sizes and returns a BuiltinModel.
BUILTIN_MODELS: dict[str, Callable[..., BuiltinModel]] = {
    "mlp": mlp, "resnet": resnet, "gpt": gpt, "unet": unet, "resnet_skip": resnet_skip}

#: The demo's model: small enough to profile in seconds on a 2-core CPU.
DEFAULT_MODEL = "gpt"


def build_model(name: str = DEFAULT_MODEL, **sizes: Any) -> BuiltinModel:
    """Build a built-in model by name with optional sizes (see each builder)."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown model {name!r}; built-in models are {sorted(BUILTIN_MODELS)}")
    return BUILTIN_MODELS[name](**sizes)


def builtin_job(name: str, batch_size: int, *, seed: int = 0, dtype: str = "float32",
                **sizes: Any) -> tuple[nn.Sequential, Callable, torch.Tensor, torch.Tensor]:
    """``(module, loss_fn, inputs, targets)`` of a built-in model: deterministic and picklable
    through ``functools.partial``, so every rank of a multi-process run builds the same."""
    torch_dtype = getattr(torch, dtype)
    built = build_model(name, seed=seed, **sizes)
    built.module.to(torch_dtype)
    inputs, targets = built.make_batch(batch_size, seed=seed, dtype=torch_dtype)
    return built.module, built.loss_fn, inputs, targets
