"""Training scripts for the `nanguard run --preflight` tests, written to tmp_path by the tests:
ordinary loops (DataLoaders, nn.Module classes, loss modules and functional losses, schedulers,
clipping) with one planted problem each, or none."""

DEEP_MLP_BAD_INIT = '''
import torch
from torch import nn

torch.manual_seed(0)


class MLP(nn.Module):
    def __init__(self, depth=8, width=128):
        super().__init__()
        layers = [nn.Linear(32, width), nn.ReLU()]
        for _ in range(depth - 2):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers += [nn.Linear(width, 10)]
        self.net = nn.Sequential(*layers)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=1.0)  # "unit Gaussian" init: far too large
                nn.init.zeros_(m.bias)

    def forward(self, x):
        return self.net(x)


model = MLP()
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
loss_fn = nn.CrossEntropyLoss()
X, Y = torch.randn(1024, 32), torch.randint(0, 10, (1024,))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=128,
                                     shuffle=True)
for epoch in range(2):
    for x, y in loader:
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print("epoch", epoch, loss.item())
'''

MLP = '''
import sys

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
lr = float(sys.argv[1]) if len(sys.argv) > 1 else 0.05
X = torch.randn(512, 20)
Y = (X @ torch.randn(20, 5)).argmax(1)
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                      nn.Linear(64, 5))
opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
for epoch in range(3):
    for i in range(0, 512, 64):
        x, y = X[i:i + 64], Y[i:i + 64]
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print("epoch", epoch, loss.item())
'''

CNN = '''
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.c2, self.b2 = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.fc = nn.Linear(32 * 7 * 7, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.b1(self.c1(x))), 2)
        x = F.max_pool2d(F.relu(self.b2(self.c2(x))), 2)
        return self.fc(x.flatten(1))


X, Y = torch.randn(256, 1, 28, 28), torch.randint(0, 10, (256,))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=64,
                                     shuffle=True)
model = CNN()
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
crit = nn.CrossEntropyLoss(label_smoothing=0.1)
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad(set_to_none=True)
        loss = crit(model(x), y)
        loss.backward()
        opt.step()
    print("epoch", epoch, loss.item())
'''

TRANSFORMER_LM = '''
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
V, T, D = 64, 32, 64


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.zeros(T, D))
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((T, T), float("-inf")), 1))

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x, self.mask)
        return self.head(self.ln(x))


data = torch.randint(0, V, (20000,))


def batch(bs=32):
    i = torch.randint(0, len(data) - T - 1, (bs,))
    return (torch.stack([data[j:j + T] for j in i]),
            torch.stack([data[j + 1:j + T + 1] for j in i]))


model = LM()
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
for step in range(20):
    x, y = batch()
    logits = model(x)
    loss = F.cross_entropy(logits.view(-1, V), y.view(-1))
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
print("loss", loss.item())
'''

HAND_WRITTEN_LOSS = '''
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 8), torch.randn(64, 1)
for step in range(5):
    loss = ((model(x) - y) ** 2).mean()  # no torch.nn.functional loss to replay
    opt.zero_grad()
    loss.backward()
    opt.step()
print("done", loss.item())
'''

SIGMOID_BCE = '''
import torch
from torch import nn

torch.manual_seed(0)


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return torch.sigmoid(self.head(self.body(x)))  # then BCELoss: saturates


model = Classifier()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
crit = nn.BCELoss()
x, y = torch.randn(128, 16), torch.randint(0, 2, (128, 1)).float()
for step in range(5):
    loss = crit(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
'''

LOG_SOFTMAX_BY_HAND = '''
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        return torch.log(F.softmax(self.fc(x), dim=-1))  # no floor: log(0) once it saturates


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(128, 16), torch.randint(0, 10, (128,))
for step in range(5):
    loss = F.nll_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
'''

NON_INVASIVE = '''
import random
import sys

import numpy as np
import torch
from torch import nn

torch.manual_seed(0)
random.seed(0)
np.random.seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 64),
                      nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 4))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
X, Y = torch.randn(512, 16), torch.randint(0, 4, (512,))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=64,
                                     shuffle=True)
crit = nn.CrossEntropyLoss()
losses = []
for epoch in range(2):
    for x, y in loader:
        loss = crit(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "losses": losses,
            "rng": torch.get_rng_state(), "draw": torch.rand(4),
            "py": random.random(), "np": float(np.random.rand())}, sys.argv[1])
'''
