"""PyTorch reference for memtrain's Muon step (tests/optim/muon_test.cpp).

Usage: muon_reference.py DIR ROWS COLS STEPS LR MUON_LR MOMENTUM WEIGHT_DECAY
Reads DIR/w.f32 (a ROWS x COLS block matrix, memtrain's (in, out) layout), DIR/gain.f32 (ROWS
floats: a gain, which takes AdamW's step) and DIR/g<k>.f32 for k = 1..STEPS (the gradients of
both, matrix first), and writes DIR/out.f32 (the matrix, then the gain, after STEPS steps).

The reference is written here from Muon's definition (Jordan et al. 2024), in fp32:
  buf = lerp(buf, g, 1 - mu); u = lerp(g, buf, mu)                (Nesterov momentum)
  X = u / (|u|_F + 1e-7), transposed when taller than wide; 5 times:
      A = X X^T; B = b A + c A A; X = a X + B X              (a, b, c = 3.4445, -4.7750, 2.0315)
  p = p (1 - lr_muon wd) - lr_muon sqrt(max(1, cols / rows)) X
and torch.optim.AdamW (betas 0.9, 0.95, eps 1e-8, no weight decay on the gain) for the gain.
"""
import sys

import numpy as np
import torch


def newton_schulz5(g):
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.clone()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        A = x @ x.T
        B = b * A + c * (A @ A)
        x = a * x + B @ x
    return x.T if tall else x


def main():
    d = sys.argv[1]
    rows, cols, steps = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    lr, muon_lr, mu, wd = (float(v) for v in sys.argv[5:9])
    torch.set_num_threads(1)
    w = torch.from_numpy(np.fromfile(f"{d}/w.f32", dtype=np.float32).reshape(rows, cols))
    gain = torch.nn.Parameter(torch.from_numpy(np.fromfile(f"{d}/gain.f32", dtype=np.float32)))
    adam = torch.optim.AdamW([gain], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    buf = torch.zeros_like(w)
    for k in range(1, steps + 1):
        g = torch.from_numpy(np.fromfile(f"{d}/g{k}.f32", dtype=np.float32))
        gw, gg = g[: rows * cols].reshape(rows, cols), g[rows * cols :]
        buf.lerp_(gw, 1 - mu)
        u = gw.lerp(buf, mu)
        o = newton_schulz5(u)
        w = w * (1 - muon_lr * wd) - muon_lr * max(1.0, cols / rows) ** 0.5 * o
        gain.grad = gg.clone()
        adam.step()
    np.concatenate([w.numpy().ravel(), gain.detach().numpy()]).astype(np.float32).tofile(
        f"{d}/out.f32")


if __name__ == "__main__":
    main()
