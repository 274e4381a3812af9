"""PyTorch's default allocator on the 7B SDPA decode (decode_progress's model): its segments at chosen tokens."""
import json, os, sys, time
from pathlib import Path
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.streamers import BaseStreamer
from hil.probes.workloads import LONG7B_CONFIG

prompt, new = int(sys.argv[1]), int(sys.argv[2])
marks = {int(x) for x in sys.argv[3].split(",")}
out = Path(os.environ["OUT"])
config = LlamaConfig(**LONG7B_CONFIG)
config._attn_implementation = "sdpa"
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    model = LlamaForCausalLM(config)
model.eval()
torch.cuda.synchronize()

def segs():
    return [{"address": s["address"], "total_size": s["total_size"], "allocated_size": s["allocated_size"],
             "pool": "small" if s["segment_type"] == "small" else "large",
             "blocks": [[b["size"], b["state"][0]] for b in s["blocks"]]} for s in torch.cuda.memory_snapshot()]

class Marks(BaseStreamer):
    def __init__(self, tag):
        self.n, self.tag, self.got = -1, tag, {}
    def put(self, value):
        self.n += 1
        if self.tag == "main" and self.n in marks:
            torch.cuda.synchronize()
            self.got[self.n] = {"reserved": torch.cuda.memory_reserved(), "peak_reserved": torch.cuda.max_memory_reserved(),
                                "allocated": torch.cuda.memory_allocated(), "segments": segs()}
            print("mark", self.n, torch.cuda.memory_reserved(), flush=True)
    def end(self):
        pass

for tag, n in (("warm", 32), ("main", new)):
    ids = torch.randint(0, config.vocab_size, (1, prompt), device="cuda")
    st = Marks(tag)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, use_cache=True, pad_token_id=0, streamer=st)
    torch.cuda.synchronize()
    print(tag, "peak_res", torch.cuda.max_memory_reserved(), "peak_alloc", torch.cuda.max_memory_allocated(), flush=True)
    if tag == "main":
        st.got["end"] = {"reserved": torch.cuda.memory_reserved(), "peak_reserved": torch.cuda.max_memory_reserved(),
                         "segments": segs()}
        (out / f"segs-p{prompt}-n{new}.json").write_text(json.dumps(st.got))
