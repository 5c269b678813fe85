import sys, torch
sys.path.insert(0, "tests/engine")
from spanllm.engine.sampler import BatchSampler, SamplingParams, apply_penalties
from test_sampler_gpu import _featured, Req, VOCAB
CPU, DEV = torch.device("cpu"), torch.device("cuda")
b = 40
g = torch.Generator().manual_seed(0)
params = _featured(b, greedy=True)
reqs = [Req(f"r{i}", torch.randint(0, VOCAB, (50,), generator=g).tolist()) for i in range(b)]
S = {CPU: BatchSampler(CPU, seed=1), DEV: BatchSampler(DEV, seed=1)}
for step in range(6):
    logits = torch.randn(b, VOCAB, generator=g) * 4
    logits[:, :20] += 8.0
    proc = {}
    outs = {}
    for d, s in S.items():
        x = logits.clone().to(d)
        outs[d] = s.sample(x, params, [()] * b, [None] * b, reqs)
        proc[d] = x.cpu()
    tc, tg = outs[CPU].tokens.tolist(), outs[DEV].tokens.cpu().tolist()
    for i, (a, c) in enumerate(zip(tc, tg)):
        if a != c:
            pc, pg = proc[CPU][i], proc[DEV][i]
            print("step", step, "row", i, "cpu", a, "gpu", c, params[i])
            print(" cpu proc[a], proc[c]:", pc[a].item(), pc[c].item(), " gpu proc[a], proc[c]:", pg[a].item(), pg[c].item())
            print(" raw:", logits[i, a].item(), logits[i, c].item(), "in prompt:", a in reqs[i].prompt_ids, c in reqs[i].prompt_ids)
            print(" max |cpu-gpu| processed:", (pc - pg).abs().max().item(), "argmax cpu/gpu of each:", pc.argmax().item(), pg.argmax().item())
    print("step", step, "mismatches", sum(a != c for a, c in zip(tc, tg)))
