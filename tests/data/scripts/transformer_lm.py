"""A small transformer language model on synthetic tokens, with gradient accumulation.

Unmodified training code for `perfloop run` (in the style of pytorch/examples
word_language_model): four micro-batches per optimizer step, AdamW, a CrossEntropyLoss
module. Prints ``steps=N`` (optimizer steps) at the end.
"""

import argparse
import math

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class TinyLM(nn.Module):
    def __init__(self, vocab=256, d=64, heads=4, layers=2, seq=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, seq, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, tokens):
        x = self.embed(tokens) * math.sqrt(self.embed.embedding_dim) + self.pos
        return self.head(self.encoder(x, mask=self.mask, is_causal=True))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    n = args.steps * args.accum * args.batch_size
    tokens = torch.randint(0, 256, (n, args.seq + 1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch_size)
    model = TinyLM(seq=args.seq)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model.train()
    steps = 0
    for i, (x, y) in enumerate(loader):
        logits = model(x)
        loss = criterion(logits.reshape(-1, logits.size(-1)), y.reshape(-1)) / args.accum
        loss.backward()
        if (i + 1) % args.accum == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
    print(f"steps={steps}")


if __name__ == "__main__":
    main()
