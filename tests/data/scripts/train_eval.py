"""Train and evaluate each epoch with two DataLoaders (pytorch/examples mnist style).

Unmodified training code for `perfloop run`: an MLP classifier, SGD with momentum, and an
evaluation loop under ``torch.no_grad()`` after every epoch. Prints ``steps=N`` (training
steps) and ``eval_batches=M`` at the end.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def train(model, loader, optimizer):
    model.train()
    steps = 0
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        steps += 1
    return steps


def test(model, loader):
    model.eval()
    correct = batches = 0
    with torch.no_grad():
        for x, y in loader:
            correct += (model(x).argmax(dim=1) == y).sum().item()
            batches += 1
    return correct, batches


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--train-samples", type=int, default=512)
    p.add_argument("--test-samples", type=int, default=256)
    args = p.parse_args()
    torch.manual_seed(2)
    torch.set_num_threads(1)
    mk = lambda n: TensorDataset(torch.randn(n, 128), torch.randint(0, 10, (n,)))  # noqa: E731
    train_loader = DataLoader(mk(args.train_samples), batch_size=32, shuffle=True)
    test_loader = DataLoader(mk(args.test_samples), batch_size=64)
    model = nn.Sequential(
        nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    steps = eval_batches = 0
    for epoch in range(1, args.epochs + 1):
        steps += train(model, train_loader, optimizer)
        correct, batches = test(model, test_loader)
        eval_batches += batches
        print(f"epoch {epoch}: accuracy {correct / args.test_samples:.3f}")
    print(f"steps={steps} eval_batches={eval_batches}")


if __name__ == "__main__":
    main()
