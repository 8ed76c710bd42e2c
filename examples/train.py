"""Train a small Hugging Face GPT-2 (random init, no download) with plait on N ranks.

    plait run -n 2 examples/train.py                 # 2 pipeline stages, cut by the planner
    plait run -n 4 examples/train.py --dp 2          # 2 stages x 2 data-parallel replicas
    python examples/train.py                         # one process, one stage

PLAIT_EXAMPLE_EPOCHS=1 sets the default of --epochs (the test suite runs these commands with it).
"""

import argparse
import os

import torch
import torch.nn.functional as F
import transformers

import plait

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the pipeline")
parser.add_argument("--epochs", type=int, default=int(os.environ.get("PLAIT_EXAMPLE_EPOCHS", 4)))
parser.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b or zbh1")
args = parser.parse_args()
block_size = 32       # T: tokens of context
batch_size = 64       # B: global batch, split over the dp replicas
num_microbatches = 4  # each replica's share of a batch goes through the pipeline in 4 pieces

# -- data: a character-level corpus, the same windows on every rank (seeded) ------------------
text = ("a pipeline cuts a model into stages; each rank runs one stage and hands its activations "
        "to the next. micro-batches keep every stage busy while the others work. ") * 40
chars = sorted(set(text))
data = torch.tensor([chars.index(c) for c in text])                # (N,) token ids
g = torch.Generator().manual_seed(0)
starts = torch.randint(0, len(data) - block_size - 1, (1024,), generator=g)
x = torch.stack([data[s:s + block_size] for s in starts])          # (1024, T) inputs
y = torch.stack([data[s + 1:s + block_size + 1] for s in starts])  # (1024, T) next tokens

# -- model: an ordinary transformers GPT-2, the same initial weights on every rank ------------
torch.manual_seed(0)
gpt_config = transformers.GPT2Config(
    vocab_size=len(chars), n_positions=block_size, n_embd=64, n_layer=4, n_head=4,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
net = transformers.GPT2LMHeadModel(gpt_config)                     # the LM head is tied to wte


def lm_loss(out, target):
    """Next-token cross entropy: out.logits (B, T, V) against target (B, T), mean over tokens."""
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


# -- parallelise: plait captures the layers, cuts them into stages and runs the schedule ------
model = plait.Model(
    net,
    config=plait.Config(dp=args.dp, num_microbatches=num_microbatches, schedule=args.schedule),
    optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),  # each rank: its stage's params
    loss=lm_loss)

# -- train loop --------------------------------------------------------------------------------
before = model.evaluate(x[:256], y[:256], batch_size=batch_size)["loss"]  # same on every rank
history = model.fit(x, y, epochs=args.epochs, batch_size=batch_size, shuffle=True, verbose=0)
after = model.evaluate(x[:256], y[:256], batch_size=batch_size)["loss"]

# -- sample: the full, unsplit state (gathered on every rank) back in the plain model ---------
state = model.state_dict()  # every rank calls it; `net` gets back the stages this rank did not run
if model.rank == 0:
    losses = ", ".join(f"{v:.3f}" for v in history.history["loss"])
    print(model.plan)
    print(f"loss per epoch: {losses}; on 256 windows {before:.3f} -> {after:.3f}")
    net.load_state_dict(state)
    idx = x[:1, :block_size]                                       # (1, T) a prompt
    with torch.no_grad():
        for _ in range(60):
            logits = net(idx[:, -block_size:]).logits              # (1, T, V)
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    print("sample:", repr("".join(chars[i] for i in idx[0, block_size:].tolist())))
