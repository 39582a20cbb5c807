"""Plan your own model: a small vision-transformer-like classifier written in plain PyTorch,
with a loss function passed separately, on one DGX H100 node (8 GPUs) viewed as a 2 x 4 mesh.

    python examples/custom_model.py            # plan, print, explain one block, draw HTML
    autopar plan examples/custom_model.py:build --cluster dgx-h100 --mesh 2x4

``build`` follows the factory convention of ``autopar plan`` (see autopar.factory): it returns
``(model, example_inputs, loss_fn, example_target)``. Tensors are created on the meta device, so
even large sizes cost no memory.
"""

import torch
from torch import nn
from torch.nn import functional as F

from autopar import Cluster
from autopar.compile import compile


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, w)
        x = x + self.proj(a)
        return x + self.mlp(self.norm2(x))


class Classifier(nn.Module):
    def __init__(self, *, patch_dim: int, width: int, heads: int, depth: int, classes: int):
        super().__init__()
        self.embed = nn.Linear(patch_dim, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, patches):
        x = self.embed(patches)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


def build(*, batch: int = 256, patches: int = 196, patch_dim: int = 768, width: int = 1024,
          heads: int = 16, depth: int = 4, classes: int = 1000, device: str = "meta"):
    """The factory: ``(model, example_inputs, loss_fn, example_target)``."""
    with torch.device(device):
        model = Classifier(patch_dim=patch_dim, width=width, heads=heads, depth=depth, classes=classes)
        x = torch.randn(batch, patches, patch_dim)
        y = torch.randint(0, classes, (batch,))
    return model, (x,), F.cross_entropy, y


def main() -> None:
    model, inputs, loss_fn, target = build()
    cluster = Cluster.preset("dgx-h100", nodes=1, mesh_shape=(2, 4))
    plan = compile(model, cluster, example_inputs=inputs, loss_fn=loss_fn, example_target=target).plan
    print(plan.summary())
    print()
    print(plan.explain("blocks.1.mlp", top=2))
    print("\nwrote", plan.render("custom_model_plan.html"))


if __name__ == "__main__":
    main()
