"""PyTorch reference for memtrain's Adafactor step (tests/optim/adafactor_test.cpp).

Usage: adafactor_reference.py DIR ROWS COLS STEPS LR WEIGHT_DECAY BETA2_DECAY CLIP
Reads DIR/w.f32 (a ROWS x COLS matrix, which decays), DIR/gain.f32 (ROWS floats, which does not)
and DIR/g<k>.f32 for k = 1..STEPS (the gradients of both, matrix first), and writes DIR/out.f32
(the matrix, then the gain, after STEPS steps).

Debian's PyTorch predates torch.optim.Adafactor (2.5), so the step is written here from its
documented algorithm, in fp32 tensor operations as torch.optim.Adafactor's single-tensor path
runs them (eps1 = the dtype's epsilon, eps2 = 1e-3):
  1 - beta2_t = t^beta2_decay;  rho = min(lr, 1 / sqrt(t));  alpha = max(eps2, RMS(W)) rho
  W *= 1 - lr wd                                                (the matrix only)
  matrix: R = lerp(R, |g|_row^2 / cols); C = lerp(C, |g|_col^2 / rows); V = R C / max(mean R, eps1)
  else:   V = lerp(V, g^2)
  U = G rsqrt(max(V, eps1^2));  W -= alpha / max(1, RMS(U) / clip) U
"""
import sys

import numpy as np
import torch


def step(param, grad, state, t, lr, wd, beta2_decay, clip, decays):
    eps1, eps2 = torch.finfo(torch.float32).eps, 1e-3
    one_minus_beta2 = t ** beta2_decay
    rho = min(lr, 1 / t ** 0.5)
    alpha = max(eps2, param.norm(2).item() / param.numel() ** 0.5) * rho
    if decays and wd != 0:
        param.mul_(1 - lr * wd)
    if grad.dim() > 1:
        row_mean = torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1))
        state["row"].lerp_(row_mean, one_minus_beta2)
        col_mean = torch.norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2))
        state["col"].lerp_(col_mean, one_minus_beta2)
        var = state["row"] @ state["col"]
        var.div_(state["row"].mean(dim=-2, keepdim=True).clamp_(min=eps1))
    else:
        state["var"].lerp_(grad * grad, one_minus_beta2)
        var = state["var"].clone()
    update = var.clamp_(min=eps1 * eps1).rsqrt_().mul_(grad)
    denom = max(1.0, update.norm(2).item() / (update.numel() ** 0.5 * clip))
    param.add_(update, alpha=-alpha / denom)


def main():
    d = sys.argv[1]
    rows, cols, steps = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    lr, wd, beta2_decay, clip = (float(v) for v in sys.argv[5:9])
    torch.set_num_threads(1)
    w = torch.from_numpy(np.fromfile(f"{d}/w.f32", dtype=np.float32).reshape(rows, cols))
    gain = torch.from_numpy(np.fromfile(f"{d}/gain.f32", dtype=np.float32))
    sw = {"row": torch.zeros(rows, 1), "col": torch.zeros(1, cols)}
    sg = {"var": torch.zeros(rows)}
    for k in range(1, steps + 1):
        g = torch.from_numpy(np.fromfile(f"{d}/g{k}.f32", dtype=np.float32))
        step(w, g[: rows * cols].reshape(rows, cols), sw, float(k), lr, wd, beta2_decay, clip, True)
        step(gain, g[rows * cols:], sg, float(k), lr, wd, beta2_decay, clip, False)
    np.concatenate([w.numpy().ravel(), gain.numpy()]).astype(np.float32).tofile(f"{d}/out.f32")


if __name__ == "__main__":
    main()
