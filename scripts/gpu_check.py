"""GPU check of kernels_cupy: correctness, bandwidth, end-to-end tokens, engine throughput.

Run through ``scripts/gpu_check.sh`` (which picks the python, installs carried wheels and tees the log).
Sections (``--parts``, default all): ``kernels`` (every kernel vs a float64 torch reference and
``backend.attention.torch_ref.TorchAttention`` on fresh random ragged inputs, NaN-poisoned outputs),
``bandwidth`` (decode-attention K/V bytes read per second vs a device-to-device copy measured in the same
run), ``e2e`` (greedy tokens + logits of ModelRunner with the cupy and torch backends vs the reference
fixtures in ``$GPU_CHECK_FIXTURES``, else ``tests/fixtures``), ``engine`` (aggregate decode tokens/s
through backend.engine.Engine at batch 1, 64, 256).

Writes ``$OUT/gpu_check.json`` (every figure) when ``--out``/``$OUT`` is set; prints a table last.
Exit status: 0 all checks pass, 1 a check failed, 2 no CUDA GPU (said in one line, no traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ROWS: list[dict] = []  # the final table
INFO: dict = {}


def row(section: str, case: str, value: str, limit: str = "", status: str = "INFO") -> None:
    ROWS.append(dict(section=section, case=case, value=value, limit=limit, status=status))
    print(f"[{section}] {case}: {value} {('(' + limit + ')') if limit else ''} {status}", flush=True)


# ----------------------------------------------------------------------------- reference
def ref_attention(query, k_cache, v_cache, meta, scale):
    """float64 paged causal attention, one sequence at a time: ``[T, H, D]`` float64."""
    import torch

    T, H, D = query.shape
    Hkv, bs = k_cache.shape[2], k_cache.shape[1]
    G = H // Hkv
    out = torch.empty((T, H, D), dtype=torch.float64, device=query.device)
    qsl = meta.query_start_loc.tolist()
    bt = meta.block_tables.long()
    for i, L in enumerate(meta.seq_lens_cpu):
        qs, qe = qsl[i], qsl[i + 1]
        n = qe - qs
        nblk = -(-L // bs)
        K = k_cache[bt[i, :nblk]].reshape(-1, Hkv, D)[:L].double()
        V = v_cache[bt[i, :nblk]].reshape(-1, Hkv, D)[:L].double()
        q = query[qs:qe].double().view(n, Hkv, G, D)
        s = torch.einsum("nkgd,lkd->kgnl", q, K) * scale
        qpos = torch.arange(L - n, L, device=query.device)
        mask = torch.arange(L, device=query.device)[None, :] <= qpos[:, None]  # [n, L]
        s = s.masked_fill(~mask, float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[qs:qe] = torch.einsum("kgnl,lkd->nkgd", p, V).reshape(n, H, D)
    return out


def make_batch(seqs, Hkv, G, D, bs, dtype, device, gen, spare_blocks=7):
    """Random paged batch. ``seqs``: list of (cached_len, new_len); decodes (new_len 1) must come first.

    Returns (meta, query, key, value, k_cache, v_cache): caches random everywhere, block tables shuffled.
    """
    import torch

    from backend.attention.base import AttentionMetadata

    need = [-(-(c + n) // bs) for c, n in seqs]
    nblocks = sum(need) + spare_blocks
    perm = torch.randperm(nblocks, generator=gen).tolist()
    tables, pos = [], 0
    for k in need:
        tables.append(perm[pos : pos + k])
        pos += k
    width = max(need)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    slots, qsl = [], [0]
    for (c, n), t in zip(seqs, tables):
        slots += [t[p // bs] * bs + p % bs for p in range(c, c + n)]
        qsl.append(qsl[-1] + n)
    T = qsl[-1]
    H = Hkv * G
    nd = 0
    for _, n in seqs:
        if n != 1:
            break
        nd += 1
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32, device=device),
        block_tables=bt.to(device),
        num_decodes=nd,
        max_query_len=max(n for _, n in seqs),
        max_seq_len=max(c + n for c, n in seqs),
        block_size=bs,
        seq_lens_cpu=[c + n for c, n in seqs],
        query_lens_cpu=[n for _, n in seqs],
    )
    dgen = torch.Generator(device=device).manual_seed(int(torch.randint(2**31, (1,), generator=gen)))

    def rnd(*shape):
        return torch.randn(*shape, generator=dgen, device=device, dtype=torch.float32).to(dtype)

    k_cache = rnd(nblocks, bs, Hkv, D)
    v_cache = rnd(nblocks, bs, Hkv, D)
    query, key, value = rnd(T, H, D), rnd(T, Hkv, D), rnd(T, Hkv, D)
    return meta, query, key, value, k_cache, v_cache


def rel_err(out, ref) -> float:
    out = out.double()
    if not bool(out.isfinite().all()):
        return float("nan")
    return float((out - ref).norm() / ref.norm())


def check_kernels(quick: bool) -> None:
    import random

    import torch

    from kernels_cupy.attention import CupyAttention

    if RUN["device"] != "cuda":  # --cpu-dry-run: the same code path on the CPU emulator, small sizes
        from kernels_cupy.emu import EmuAttention as CupyAttention  # noqa: F811
    try:
        from backend.attention.torch_ref import TorchAttention

        tref = TorchAttention()
    except Exception as e:  # noqa: BLE001
        tref = None
        row("kernels", "torch_ref", f"unavailable ({type(e).__name__}: {e}); float64 reference only")
    dev = torch.device(RUN["device"])
    seed = int(time.time() * 1000) % 2**31
    INFO["kernel_seed"] = seed
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    attn = CupyAttention()
    attn.poison_scratch = True
    tol = 1e-2
    dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16}
    configs = [(dn, D, G) for dn in dtypes for D in (64, 128) for G in (1, 3, 8)][: RUN["kernel_configs"]]
    X = RUN["max_len"]  # longest context (8192 on the GPU)
    worst: dict[str, float] = {}
    for ci, (dn, D, G) in enumerate(configs):
        dtype = dtypes[dn]
        bs = (16, 32, 16, 8)[ci % 4]
        Hkv = (2, 3, 4)[ci % 3]
        # decodes: ragged 1..8192 (partition and block edges + random), then prefill chunks (cached, new)
        dec = [1, 2, bs - 1, bs, bs + 1, 63, 64, 65, 511, 512, 513, X - 1, X]
        dec = [d for d in dec if d <= X] + [rng.randint(1, X) for _ in range(3 if quick else 11)]
        rng.shuffle(dec)
        pre = [
            (0, 1 + rng.randint(1, 40)),
            (0, 300),
            (rng.randint(1, 3000), rng.randint(2, 200)),
            (rng.randint(4000, 7800), rng.randint(2, 390)),
            (5, 2),
            (0, 2),
            (rng.randint(1, 100), 97),
        ]
        if X < 8192:  # dry run: shrink the prefill chunks too
            pre = [(min(c, X // 2), min(n, X // 2)) for c, n in pre]
        cases = {
            "mixed": [(L - 1, 1) for L in dec] + pre,
            "decode": [(L - 1, 1) for L in dec],
            "decode-short": [(rng.randint(0, 63), 1) for _ in range(5)],  # one partition: direct write (v1)
            "decode-one-long": [
                (rng.randint(X // 2, X - 1), 1)
            ],  # small partitions, many of them (v2 reduce)
            "prefill": pre[:4],
        }
        if ci % 4 == 0:
            cases["decode-bigbatch"] = [
                (rng.randint(0, X - 1), 1) for _ in range(RUN["big_batch"])
            ]  # partition 512 (v2)
        for cname, seqs in cases.items():
            name = f"{dn} D={D} G={G} Hkv={Hkv} bs={bs} {cname}"
            try:
                meta, q, k, v, kc, vc = make_batch(seqs, Hkv, G, D, bs, dtype, dev, gen)
                # write_kv against index_copy on clones (bit-exact), with some rows skipped (slot -1)
                kc2, vc2 = kc.clone(), vc.clone()
                skip = torch.rand(q.shape[0], generator=gen) < 0.1
                meta_skip = dataclasses.replace(
                    meta, slot_mapping=torch.where(skip.to(dev), -1, meta.slot_mapping)
                )
                attn.write_kv(k, v, kc2, vc2, meta_skip)
                ek, ev = kc.clone(), vc.clone()
                keep = ~skip.to(dev)
                ek.view(-1, Hkv, D)[meta.slot_mapping[keep]] = k[keep]
                ev.view(-1, Hkv, D)[meta.slot_mapping[keep]] = v[keep]
                ok_w = bool(torch.equal(ek, kc2) and torch.equal(ev, vc2))
                if not ok_w or cname == "mixed":
                    row(
                        "kernels",
                        f"write_kv {name} ({int(skip.sum())} skipped)",
                        "bit-exact" if ok_w else "MISMATCH",
                        "exact",
                        "PASS" if ok_w else "FAIL",
                    )
                attn.clear_cache()
                attn.write_kv(k, v, kc, vc, meta)
                out = torch.full_like(q, float("nan"))
                scale = D**-0.5
                attn.forward(q, kc, vc, meta, scale, out=out)
                _sync()
                ref = ref_attention(q, kc, vc, meta, scale)
                err = rel_err(out, ref)
                nan_rows = int((~out.isfinite()).any(dim=-1).any(dim=-1).sum())
                extra = ""
                if tref is not None:
                    to = tref.forward(q, kc, vc, meta, scale)
                    extra = f", torch_ref vs f64 {rel_err(to, ref):.2e}, cupy vs torch_ref {rel_err(out, to.double()):.2e}"
                ok = err < tol and nan_rows == 0
                worst[dn] = max(worst.get(dn, 0.0), err if err == err else float("inf"))
                row(
                    "kernels",
                    f"attention {name} (T={q.shape[0]}, nd={meta.num_decodes}, maxlen={meta.max_seq_len})",
                    f"rel err {err:.2e}, unwritten/NaN rows {nan_rows}{extra}",
                    f"< {tol:g}",
                    "PASS" if ok else "FAIL",
                )
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row("kernels", f"attention {name}", f"ERROR {type(e).__name__}: {e}", "", "FAIL")
            finally:
                attn.clear_cache()
    for dn, w in worst.items():
        INFO[f"worst_rel_err_{dn}"] = w


# ----------------------------------------------------------------------------- bandwidth
def _time_ms(fn, reps: int, rounds: int = 5) -> float:
    """Median per-call milliseconds of ``fn`` over ``rounds`` rounds of ``reps`` back-to-back calls (CUDA events)."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    res = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        res.append(a.elapsed_time(b) / reps)
    res.sort()
    return res[len(res) // 2]


def check_bandwidth(quick: bool) -> None:
    import cupy
    import torch

    from kernels_cupy.attention import CupyAttention

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1234)
    # copy ceiling: 2 GiB -> 2 GiB, bytes read + written
    n = 1 << 30
    x = torch.randn(n, device=dev, dtype=torch.bfloat16, generator=gen)
    y = torch.empty_like(x)
    ms = _time_ms(functools.partial(y.copy_, x), reps=10)
    copy_bw = 2 * 2 * n / (ms * 1e-3)
    INFO["copy_GBps"] = copy_bw / 1e9
    row("bandwidth", "device-to-device copy 2 GiB (read+write)", f"{copy_bw / 1e9:.0f} GB/s ({ms:.3f} ms)")
    del x, y

    Hkv, D, bs = 8, 128, 16
    dtype = torch.bfloat16
    max_tokens = 256 * 8192
    nblocks = max_tokens // bs
    kc = torch.randn(nblocks, bs, Hkv, D, device=dev, dtype=dtype, generator=gen)
    vc = torch.randn(nblocks, bs, Hkv, D, device=dev, dtype=dtype, generator=gen)
    from backend.attention.base import AttentionMetadata

    attn = CupyAttention()
    shapes = [(B, L, 4) for B in (1, 64, 256) for L in (512, 2048, 8192)]
    shapes += [(256, 2048, 1), (256, 2048, 8)]
    # tuning variants at the acceptance point: (partition size, KernelConfig tuning); first = default
    tune = [
        (None, {}),
        (256, {}),
        (1024, {}),
        (None, {"decode_warps": 8}),
        (None, {"decode_warps": 2}),
        (None, {"k_unroll": 2, "v_unroll": 4}),
        (None, {"k_unroll": 1, "v_unroll": 2}),
        (None, {"decode_warps": 8, "k_unroll": 4, "v_unroll": 8}),
    ]
    results = []
    for B, L, G in shapes:
        for ps, tuning in tune if (B, L, G) == (256, 2048, 4) and not quick else tune[:1]:
            H = Hkv * G
            perm = torch.randperm(nblocks, device=dev, generator=gen)[: B * L // bs].to(torch.int32)
            meta = AttentionMetadata(
                slot_mapping=torch.zeros(B, dtype=torch.int64, device=dev),
                query_start_loc=torch.arange(B + 1, dtype=torch.int32, device=dev),
                seq_lens=torch.full((B,), L, dtype=torch.int32, device=dev),
                block_tables=perm.view(B, L // bs),
                num_decodes=B,
                max_query_len=1,
                max_seq_len=L,
                block_size=bs,
                seq_lens_cpu=[L] * B,
                query_lens_cpu=[1] * B,
            )
            q = torch.randn(B, H, D, device=dev, dtype=dtype, generator=gen)
            out = torch.full_like(q, float("nan"))  # poisoned: an unwritten row fails the check below
            attn.partition_size = ps
            attn.tuning = tuning
            from kernels_cupy.attention import choose_partition_size, default_tuning
            from kernels_cupy.compile import KernelConfig

            cfg = KernelConfig("bfloat16", D, bs, G, **(tuning or default_tuning(G)))
            stream = cupy.cuda.ExternalStream(
                torch.cuda.current_stream().cuda_stream, torch.cuda.current_device()
            )
            with cupy.cuda.Device(torch.cuda.current_device()), stream:
                plans = attn._plan(cfg, q, kc, vc, meta, D**-0.5, out)

                def launch(plans=plans):
                    for fn, grid, block, args, smem in plans:
                        fn(grid, block, args, shared_mem=smem)

                kv_bytes = 2 * B * L * Hkv * D * 2
                reps = max(5, min(200, int(2e9 / kv_bytes)))
                ms = _time_ms(launch, reps=reps)
            # correctness of the timed configuration on a few sequences (the kernels ran on this data)
            ref = ref_attention(q[:2], kc, vc, _sub(meta, 2), D**-0.5)
            err = rel_err(out[:2], ref)
            if not bool(out.isfinite().all()):
                err = float("nan")
            bw = kv_bytes / (ms * 1e-3)
            used_ps = ps or choose_partition_size(
                Hkv, B, L, bs, torch.cuda.get_device_properties(0).multi_processor_count
            )
            rec = dict(
                batch=B,
                context=L,
                gqa=G,
                heads=H,
                kv_heads=Hkv,
                head_dim=D,
                partition=used_ps,
                ms=ms,
                kv_GBps=bw / 1e9,
                frac_of_copy=bw / copy_bw,
                rel_err=err,
                tuning=tuning,
            )
            results.append(rec)
            accept = (B, L, G) == (256, 2048, 4) and ps is None and not tuning
            status = (
                ("PASS" if bw >= 0.6 * copy_bw and err < 1e-2 else "FAIL")
                if accept
                else ("INFO" if err < 1e-2 else "FAIL")
            )
            tn = "".join(f" {k}={v}" for k, v in tuning.items())
            row(
                "bandwidth",
                f"decode B={B} ctx={L} H={H}/Hkv={Hkv} D={D} bf16 ps={used_ps}{tn}",
                f"{ms * 1e3:.1f} us, K/V {bw / 1e9:.0f} GB/s = {100 * bw / copy_bw:.0f}% of copy, rel err {err:.1e}",
                ">= 60% of copy" if accept else "",
                status,
            )
            del q, out, perm, meta, plans
            attn.clear_cache()
    attn.partition_size = None
    attn.tuning = {}
    INFO["decode_bandwidth"] = results


def _sub(meta, k):
    """The first ``k`` (decode) sequences of ``meta``."""
    from backend.attention.base import AttentionMetadata

    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[:k],
        query_start_loc=meta.query_start_loc[: k + 1],
        seq_lens=meta.seq_lens[:k],
        block_tables=meta.block_tables[:k],
        num_decodes=min(k, meta.num_decodes),
        max_query_len=1,
        max_seq_len=max(meta.seq_lens_cpu[:k]),
        block_size=meta.block_size,
        seq_lens_cpu=meta.seq_lens_cpu[:k],
        query_lens_cpu=meta.query_lens_cpu[:k],
    )


# ----------------------------------------------------------------------------- end to end
def _model_path():
    from backend.model_path import default_model_path

    return default_model_path()


def _model_available(section: str) -> bool:
    """Whether the default model file is here; if not, say so in a ``skipped`` row of ``section``."""
    try:
        _model_path()
    except Exception as e:  # noqa: BLE001
        row(section, "skipped", f"model file not available here ({e})")
        return False
    return True


_RUNNERS: dict = {}
# --cpu-dry-run (tests of this script on a machine without a GPU): e2e/engine on CPU, float32, torch only
RUN = dict(
    device="cuda",
    dtype="bfloat16",
    backends=("torch", "cupy"),
    batches=(1, 64, 256),
    cases=None,
    max_len=8192,
    kernel_configs=12,
    big_batch=96,
)


def _runner(backend_name: str):
    """One ModelRunner per attention backend, shared by the e2e and engine sections."""
    from backend.model_runner import ModelRunner

    if backend_name not in _RUNNERS:
        t0 = time.perf_counter()
        _RUNNERS[backend_name] = ModelRunner(
            _model_path(),
            device=RUN["device"],
            dtype=RUN["dtype"],
            attention_backend=backend_name,
            kv_cache_bytes=2 * 1024**3,
        )
        INFO[f"load_seconds_{backend_name}"] = round(time.perf_counter() - t0, 1)
    return _RUNNERS[backend_name]


def check_e2e(quick: bool) -> None:

    try:
        from backend.batch import SeqChunk
    except Exception as e:  # noqa: BLE001
        row("e2e", "skipped", f"backend.model_runner not importable ({type(e).__name__}: {e})")
        return
    if not _model_available("e2e"):
        return
    cands = [os.environ.get("GPU_CHECK_FIXTURES", ""), ROOT / "tests" / "fixtures"]
    fx = next(
        (Path(c) / "smollm2_chats.json" for c in cands if c and (Path(c) / "smollm2_chats.json").exists()),
        None,
    )
    if fx is None:
        row("e2e", "skipped", "fixtures smollm2_chats.json not found (GPU_CHECK_FIXTURES, tests/fixtures)")
        return
    chats = json.loads(fx.read_text())["chats"][: RUN["cases"]]
    res = {}
    for backend_name in RUN["backends"]:
        runner = _runner(backend_name)
        bs = runner.block_size
        per_case = []
        t0 = time.perf_counter()
        for case in chats:
            prompt = case["prompt_ids"]
            steps = len(case["greedy_ids"])
            nblk = -(-(len(prompt) + steps + 1) // bs)
            table = list(range(nblk))
            # prefill in two chunks (exercises prefill over cached blocks), then greedy decode
            cut = max(1, len(prompt) // 2)
            runner.execute([SeqChunk(prompt[:cut], 0, table, need_logits=False)])
            logits = runner.execute([SeqChunk(prompt[cut:], cut, table)])
            first = logits[0].float().cpu()
            ids, pos, tok = [], len(prompt), int(first.argmax())
            for _ in range(steps):
                ids.append(tok)
                if tok == 2:
                    break
                lg = runner.execute([SeqChunk([tok], pos, table)])
                pos += 1
                tok = int(lg[0].argmax())
            per_case.append(dict(first_logits=first, ids=ids))
        _sync()
        res[backend_name] = (per_case, time.perf_counter() - t0)
    for backend_name, (per_case, secs) in res.items():
        worst_logit, ok_ids, n_cases = 0.0, 0, len(chats)
        for case, r in zip(chats, per_case):
            top = case["last_logits_top50"]
            d = max(abs(float(r["first_logits"][int(t)]) - float(v)) for t, v in top)
            worst_logit = max(worst_logit, d)
            gi, gaps = case["greedy_ids"], case["greedy_top2_gap"]
            lim = next((i for i, g in enumerate(gaps) if g < 0.1), len(gi))
            ok_ids += r["ids"][:lim] == gi[:lim]
        ok = worst_logit <= 0.15 and ok_ids == n_cases
        row(
            "e2e",
            f"{backend_name} backend vs fixtures ({n_cases} chats, {RUN['dtype']}, {secs:.1f} s)",
            f"max |logit diff| {worst_logit:.3f}, greedy ids match {ok_ids}/{n_cases}",
            "<= 0.15; ids equal up to first gap < 0.1",
            "PASS" if ok else "FAIL",
        )
    if "cupy" not in res or "torch" not in res:
        return
    same = sum(a["ids"] == b["ids"] for a, b in zip(res["torch"][0], res["cupy"][0]))
    d = max(
        float((a["first_logits"] - b["first_logits"]).abs().max())
        for a, b in zip(res["torch"][0], res["cupy"][0])
    )
    row(
        "e2e",
        "cupy vs torch backend",
        f"identical greedy ids {same}/{len(chats)}, max |logit diff| {d:.3f}",
        "",
        "INFO",
    )


def check_engine(quick: bool) -> None:

    try:
        from backend.engine import Engine
        from backend.protocol import SamplingParams, Submit
    except Exception as e:  # noqa: BLE001
        row("engine", "skipped", f"backend.engine API not available ({type(e).__name__}: {e})")
        return
    if not _model_available("engine"):
        return
    gen_tokens = 64 if RUN["device"] == "cuda" else 4
    for backend_name in RUN["backends"][::-1]:
        runner = _runner(backend_name)
        for B in RUN["batches"]:
            try:
                eng = Engine(
                    runner, max_num_seqs=B, max_num_batched_tokens=max(B, 2048), enable_prefix_caching=False
                )
                subs = [
                    Submit(
                        request_id=f"r{B}-{i}",
                        prompt_ids=[1] + [(17 * i + 31 * j) % 40000 + 100 for j in range(31)],
                        sampling=SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True),
                    )
                    for i in range(B)
                ]
                eng.generate(subs[: min(B, 2)])  # warm-up (compiles kernels, allocator)
                _sync()
                eng = Engine(
                    runner, max_num_seqs=B, max_num_batched_tokens=max(B, 2048), enable_prefix_caching=False
                )
                t0 = time.perf_counter()
                eng.generate(subs)
                _sync()
                dt = time.perf_counter() - t0
                toks = eng.num_generation_tokens
                row(
                    "engine",
                    f"{backend_name} decode batch {B} (prompt 32, {gen_tokens} new tokens each)",
                    f"{toks / dt:.0f} tokens/s aggregate ({toks} tokens, {eng.num_steps} steps, {dt:.2f} s)",
                )
                INFO.setdefault("engine", []).append(
                    dict(
                        backend=backend_name,
                        batch=B,
                        tokens=toks,
                        seconds=dt,
                        tokens_per_s=toks / dt,
                        steps=eng.num_steps,
                    )
                )
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row(
                    "engine", f"{backend_name} decode batch {B}", f"ERROR {type(e).__name__}: {e}", "", "FAIL"
                )


def _sync() -> None:
    import torch

    if RUN["device"] == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- main
def print_table() -> None:
    print("\n==== gpu_check summary ====")
    for k in ("gpu", "cuda_torch", "cuda_runtime", "driver", "cupy", "torch", "date"):
        if k in INFO:
            print(f"{k}: {INFO[k]}")
    w = [max(len(r[c]) for r in ROWS) if ROWS else 4 for c in ("section", "case", "value", "limit", "status")]
    for r in ROWS:
        print(
            f"{r['section']:<{w[0]}} | {r['case']:<{w[1]}} | {r['value']:<{w[2]}} | {r['limit']:<{w[3]}} | {r['status']}"
        )
    n_fail = sum(r["status"] == "FAIL" for r in ROWS)
    n_pass = sum(r["status"] == "PASS" for r in ROWS)
    print(f"PASS {n_pass}  FAIL {n_fail}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="kernels,bandwidth,e2e,engine")
    ap.add_argument("--out", default=os.environ.get("OUT") or None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cpu-dry-run", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.cpu_dry_run:  # exercise the e2e/engine code paths on CPU (float32, torch backend)
        RUN.update(
            device="cpu",
            dtype="float32",
            backends=("torch",),
            batches=(1, 3),
            cases=2,
            max_len=80,
            kernel_configs=2,
            big_batch=4,
        )
        for p in a.parts.split(","):
            dict(e2e=check_e2e, engine=check_engine, kernels=check_kernels)[p](True)
        print_table()
        return 1 if any(r["status"] == "FAIL" for r in ROWS) else 0
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        print(f"gpu_check: torch not importable ({e}); no GPU check possible", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False): nothing to check, exiting 2",
            file=sys.stderr,
        )
        return 2
    try:
        import cupy
    except Exception as e:  # noqa: BLE001
        print(
            f"gpu_check: cupy not importable ({type(e).__name__}: {e}): install cupy-cuda13x", file=sys.stderr
        )
        return 2
    INFO.update(
        date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        gpu=torch.cuda.get_device_name(0),
        cuda_torch=torch.version.cuda,
        cuda_runtime=cupy.cuda.runtime.runtimeGetVersion(),
        driver=cupy.cuda.runtime.driverGetVersion(),
        cupy=cupy.__version__,
        torch=torch.__version__,
        python=platform.python_version(),
        sms=torch.cuda.get_device_properties(0).multi_processor_count,
    )
    print(json.dumps(INFO), flush=True)
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    fns = dict(kernels=check_kernels, bandwidth=check_bandwidth, e2e=check_e2e, engine=check_engine)
    for p in parts:
        t0 = time.perf_counter()
        try:
            fns[p](a.quick)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row(p, "section crashed", f"{type(e).__name__}: {e}", "", "FAIL")
        INFO[f"seconds_{p}"] = round(time.perf_counter() - t0, 1)
        print(f"-- {p}: {INFO[f'seconds_{p}']} s", flush=True)
        if a.out:
            _dump(a.out)
    print_table()
    if a.out:
        _dump(a.out)
    return 1 if any(r["status"] == "FAIL" for r in ROWS) else 0


def _dump(out: str) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "gpu_check.json").write_text(json.dumps(dict(info=INFO, rows=ROWS), indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
