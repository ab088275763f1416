"""Word-level language model, in the style of the PyTorch word_language_model example: a
corpus tokenized into one long id stream, batchified into columns, truncated BPTT with the
hidden state carried across batches (and detached), an RNN/LSTM/GRU with an embedding encoder
and a linear decoder, and *hand-written* SGD (no torch.optim):

    for p in model.parameters():
        p.data.add_(p.grad, alpha=-lr)

with optional manual gradient clipping (`--clip`, 0 turns it off) and LR annealing on a
plateau of the validation loss.

    python rnn_lm.py --max-iters 60
    python rnn_lm.py --lr 2000 --clip 0      # fails

How it fails: `--lr 2000 --clip 0` (no clipping and a learning rate 100x the usual 20): the
plain SGD updates overshoot, the weights grow from batch to batch and the loss goes non-finite
within a few batches (optimizer divergence).
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.nn as nn

VOCAB = ("the a of to and in is it that was for on are with as his they be at one have this "
         "from or had by word but what some we can out other were all there when up use your "
         "how said an each she which do their time if will way about many then them write "
         "would like so these her long make thing see him two has look more day could go come "
         "did number sound no most people my over know water than call first who may down side "
         "been now find")
WORDS = VOCAB.split()


class Dictionary:
    def __init__(self) -> None:
        self.word2idx: dict[str, int] = {}
        self.idx2word: list[str] = []

    def add_word(self, word: str) -> int:
        if word not in self.word2idx:
            self.idx2word.append(word)
            self.word2idx[word] = len(self.idx2word) - 1
        return self.word2idx[word]

    def __len__(self) -> int:
        return len(self.idx2word)


class Corpus:
    def __init__(self, path: str | None, seed: int) -> None:
        self.dictionary = Dictionary()
        if path:
            with open(path, encoding="utf8") as f:
                lines = f.read().splitlines()
        else:
            g = torch.Generator().manual_seed(seed)
            # A toy "language": each sentence draws words from a random band of the vocabulary.
            lines = []
            for _ in range(400):
                start = int(torch.randint(0, len(WORDS) - 12, (1,), generator=g))
                ids = torch.randint(start, start + 12, (8,), generator=g).tolist()
                lines.append(" ".join(WORDS[i] for i in ids))
        n = len(lines)
        self.train = self.tokenize(lines[: int(0.8 * n)])
        self.valid = self.tokenize(lines[int(0.8 * n): int(0.9 * n)])
        self.test = self.tokenize(lines[int(0.9 * n):])

    def tokenize(self, lines: list[str]) -> torch.Tensor:
        ids = []
        for line in lines:
            for word in line.split() + ["<eos>"]:
                ids.append(self.dictionary.add_word(word))
        return torch.tensor(ids, dtype=torch.int64)


class RNNModel(nn.Module):
    """Container module with an encoder, a recurrent module, and a decoder."""

    def __init__(self, rnn_type: str, ntoken: int, ninp: int, nhid: int, nlayers: int,
                 dropout: float = 0.5, tie_weights: bool = False) -> None:
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        if rnn_type in ["LSTM", "GRU"]:
            self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        else:
            nonlinearity = {"RNN_TANH": "tanh", "RNN_RELU": "relu"}[rnn_type]
            self.rnn = nn.RNN(ninp, nhid, nlayers, nonlinearity=nonlinearity, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie_weights:
            if nhid != ninp:
                raise ValueError("When using the tied flag, nhid must be equal to emsize")
            self.decoder.weight = self.encoder.weight
        self.init_weights()
        self.rnn_type = rnn_type
        self.nhid = nhid
        self.nlayers = nlayers

    def init_weights(self) -> None:
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input: torch.Tensor, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return torch.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int):
        weight = next(self.parameters())
        if self.rnn_type == "LSTM":
            return (weight.new_zeros(self.nlayers, bsz, self.nhid),
                    weight.new_zeros(self.nlayers, bsz, self.nhid))
        return weight.new_zeros(self.nlayers, bsz, self.nhid)


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    return data.view(bsz, -1).t().contiguous()


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def get_batch(source: torch.Tensor, i: int, bptt: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq_len = min(bptt, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].view(-1)
    return data, target


def main() -> None:
    p = argparse.ArgumentParser(description="PyTorch RNN/LSTM language model")
    p.add_argument("--data", default=None, help="text file, one sentence a line")
    p.add_argument("--model", default="LSTM", help="RNN_TANH, RNN_RELU, LSTM, GRU")
    p.add_argument("--emsize", type=int, default=32)
    p.add_argument("--nhid", type=int, default=32)
    p.add_argument("--nlayers", type=int, default=2)
    p.add_argument("--lr", type=float, default=20.0, help="initial learning rate")
    p.add_argument("--clip", type=float, default=0.25, help="gradient clipping (0: none)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-iters", type=int, default=60, help="stop after this many batches")
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--bptt", type=int, default=12)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--tied", action="store_true")
    p.add_argument("--seed", type=int, default=1111)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--save", default="model.pt")
    args = p.parse_args()

    torch.manual_seed(args.seed)
    corpus = Corpus(args.data, args.seed)
    eval_batch_size = 10
    train_data = batchify(corpus.train, args.batch_size)
    val_data = batchify(corpus.valid, eval_batch_size)
    ntokens = len(corpus.dictionary)
    model = RNNModel(args.model, ntokens, args.emsize, args.nhid, args.nlayers, args.dropout,
                     args.tied)
    criterion = nn.NLLLoss()

    tracer = None
    if os.environ.get("NANTRACE"):
        from _nantrace import Tracer
        tracer = Tracer([model])

    def evaluate(data_source: torch.Tensor) -> float:
        model.eval()
        total_loss = 0.0
        hidden = model.init_hidden(eval_batch_size)
        with torch.no_grad():
            for i in range(0, data_source.size(0) - 1, args.bptt):
                data, targets = get_batch(data_source, i, args.bptt)
                output, hidden = model(data, hidden)
                hidden = repackage_hidden(hidden)
                total_loss += len(data) * criterion(output, targets).item()
        return total_loss / (len(data_source) - 1)

    iters = 0

    def train(epoch: int, lr: float) -> None:
        nonlocal iters
        model.train()
        total_loss = 0.0
        start_time = time.time()
        hidden = model.init_hidden(args.batch_size)
        for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
            if iters >= args.max_iters:
                return
            data, targets = get_batch(train_data, i, args.bptt)
            # Starting each batch, we detach the hidden state from how it was previously
            # produced. If we didn't, the model would try backpropagating all the way to
            # start of the dataset.
            if tracer:
                tracer.start()
            model.zero_grad()
            hidden = repackage_hidden(hidden)
            output, hidden = model(data, hidden)
            loss = criterion(output, targets)
            if tracer:
                tracer.loss(loss)
            loss.backward()
            if tracer:
                tracer.grads()

            # `clip_grad_norm` helps prevent the exploding gradient problem in RNNs / LSTMs.
            if args.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
            if tracer:
                tracer.updated()
            iters += 1

            total_loss += loss.item()
            if batch % args.log_interval == 0 and batch > 0:
                cur_loss = total_loss / args.log_interval
                elapsed = time.time() - start_time
                ppl = math.exp(cur_loss) if cur_loss < 700 else float("inf")
                print(f"| epoch {epoch:3d} | {batch:5d}/{len(train_data) // args.bptt:5d} "
                      f"batches | lr {lr:02.2f} | ms/batch "
                      f"{elapsed * 1000 / args.log_interval:5.2f} | loss {cur_loss:5.2f} | "
                      f"ppl {ppl:8.2f}")
                total_loss = 0.0
                start_time = time.time()

    lr = args.lr
    best_val_loss = None
    for epoch in range(1, args.epochs + 1):
        epoch_start_time = time.time()
        train(epoch, lr)
        val_loss = evaluate(val_data)
        print("-" * 89)
        print(f"| end of epoch {epoch:3d} | time: {time.time() - epoch_start_time:5.2f}s | "
              f"valid loss {val_loss:5.2f}")
        print("-" * 89)
        if not best_val_loss or val_loss < best_val_loss:
            with open(args.save, "wb") as f:
                torch.save(model.state_dict(), f)
            best_val_loss = val_loss
        else:
            # Anneal the learning rate if no improvement has been seen in the validation set.
            lr /= 4.0
        if iters >= args.max_iters:
            break


if __name__ == "__main__":
    main()
