"""An MNIST-style CNN (pytorch/examples mnist/main.py, smaller) on synthetic tensors.

Unmodified training code for `perfloop run`: TensorDataset + DataLoader, Adadelta, StepLR,
gradient clipping. Prints ``steps=N`` (optimizer steps) at the end.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(2304, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=640)
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args()
    torch.manual_seed(1)
    torch.set_num_threads(1)
    data = TensorDataset(
        torch.randn(args.samples, 1, 28, 28), torch.randint(0, 10, (args.samples,))
    )
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
    steps = 0
    for epoch in range(1, args.epochs + 1):
        model.train()
        for data, target in loader:
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            steps += 1
        scheduler.step()
        print(f"epoch {epoch} loss {loss.item():.4f}")
    print(f"steps={steps}")


if __name__ == "__main__":
    main()
