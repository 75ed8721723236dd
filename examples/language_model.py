"""Word-level language model on the glosses of WordNet, trained with `ParallaxStrategy`.

Data: the definitions ("glosses") of Debian's `wordnet-base` (/usr/share/wordnet/data.noun,
.verb, .adj, .adv; the text after '|' on each synset line), lowercased and tokenized with
`[a-z0-9']+|[.,;:!?()"]`: about 118k glosses, 1.7M tokens. Glosses are concatenated into one
stream, each followed by <eos>. Nothing is downloaded: without wordnet-base the example
stops and says how to install it.

Vocabulary: every token of the corpus (about 57k), plus <eos> (id 0) and <unk> (id 1), ids in
order of frequency.

Model: the next word from the previous k words (default 4).
    ids [B, k] -> Embedding(V ~ 57k, 64)   input table, read only by a gather: SPARSE,
                                           on the parameter servers (rows pulled per step)
               -> concatenate [B, k*64] -> Dense(256, relu)
               -> Dense(N) logits          output layer: DENSE, all-reduced with Horovod

Design choice: the output softmax covers the N most frequent words (default 8192, about 91%
of the tokens) with every other word mapped to <unk>, not all 57k words. A full 57k-way
softmax needs a 256 x 57k dense kernel (58 MB, all-reduced and Adam-updated every step) and
7x the arithmetic of the 8192-word one: measured on a 2-core laptop, 490 instead of 6200
examples/s, too slow for a one-minute run; `--output-vocab 0` trains it anyway. The input
embedding keeps the full vocabulary, so the big sparse table, the point of the example, is
unchanged. Perplexity is therefore over the N words + <unk>, lower than a full-vocabulary
perplexity would be.

Each epoch prints training loss and perplexity (mean over workers), examples/s and the MB/s
pulled from the servers; the end prints held-out loss/perplexity and a `RESULT {json}` line.

    python examples/language_model.py                      # one worker, 2 embedded servers
    parallax run -np 2 --servers 2 python examples/language_model.py
"""
from __future__ import annotations

import collections
import math
import re
import sys
from pathlib import Path

import numpy as np

from common import (EpochReport, base_parser, chief_print, fit_verbosity, global_batches,
                    make_strategy, print_result, steps_per_epoch)

import keras  # noqa: E402  (after common, which quiets TensorFlow's logging)
import tensorflow as tf  # noqa: E402

WORDNET_DIR = Path("/usr/share/wordnet")
PARTS = ("noun", "verb", "adj", "adv")
TOKEN = re.compile(r"[a-z0-9']+|[.,;:!?()\"]")
EOS, UNK = "<eos>", "<unk>"
EOS_ID, UNK_ID = 0, 1


def read_glosses(directory: Path) -> list[list[str]]:
    """Tokenized glosses of every synset, in file order."""
    missing = [p for p in PARTS if not (directory / f"data.{p}").is_file()]
    if missing:
        sys.exit(f"language_model: WordNet's data files are missing from {directory} "
                 f"(no data.{', data.'.join(missing)}). Install Debian's wordnet-base package: "
                 f"`apt-get install wordnet-base` (as root; scripts/setup_env.sh does it when "
                 f"it can), or pass --wordnet-dir DIR")
    glosses = []
    for part in PARTS:
        with open(directory / f"data.{part}", encoding="latin-1") as lines:
            for line in lines:
                if line.startswith("  "):  # the license header
                    continue
                bar = line.find("|")
                if bar >= 0:
                    tokens = TOKEN.findall(line[bar + 1:].lower())
                    if tokens:
                        glosses.append(tokens)
    return glosses


def build_vocabulary(glosses: list[list[str]]) -> dict[str, int]:
    """<eos>, <unk>, then every token by decreasing frequency (ties alphabetically)."""
    counts = collections.Counter(t for gloss in glosses for t in gloss)
    words = sorted(counts, key=lambda w: (-counts[w], w))
    return {w: i for i, w in enumerate([EOS, UNK, *words])}


def windows(glosses: list[list[str]], vocab: dict[str, int], k: int,
            output_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(contexts [n, k] of input ids, targets [n] of output classes) for every token of the
    stream `gloss <eos> gloss <eos> ...`; the stream starts with k <eos>."""
    stream = np.fromiter((vocab.get(t, UNK_ID) for gloss in glosses for t in [*gloss, EOS]),
                         dtype=np.int32)
    padded = np.concatenate([np.full(k, EOS_ID, np.int32), stream])
    contexts = np.lib.stride_tricks.sliding_window_view(padded, k)[:-1]
    targets = np.where(stream < output_vocab, stream, UNK_ID).astype(np.int32)
    return np.ascontiguousarray(contexts), targets


def build_model(vocab_size: int, output_vocab: int, args) -> keras.Model:
    ids = keras.Input((args.context,), dtype="int32", name="context")
    x = keras.layers.Embedding(vocab_size, args.embed_dim, name="words")(ids)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(args.hidden, activation="relu", name="hidden")(x)
    logits = keras.layers.Dense(output_vocab, name="next_word")(x)
    return keras.Model(ids, logits, name="word_lm")


def perplexity(logs: dict) -> dict:
    out = {"perplexity": math.exp(min(logs["loss"], 50.0))}
    if "val_loss" in logs:
        out["val_perplexity"] = math.exp(min(logs["val_loss"], 50.0))
    return out


def parse_args(argv=None):
    parser = base_parser(__doc__.split("\n")[0], epochs=3, batch_size=512,
                         steps_per_epoch=100, lr=2e-3)
    parser.add_argument("--wordnet-dir", type=Path, default=WORDNET_DIR)
    parser.add_argument("--max-sentences", type=int, default=0,
                        help="train on at most this many glosses (0: all ~116k)")
    parser.add_argument("--eval-sentences", type=int, default=2000,
                        help="glosses held out for the final perplexity")
    parser.add_argument("--context", type=int, default=4, help="previous words seen (k)")
    parser.add_argument("--embed-dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--output-vocab", type=int, default=8192,
                        help="softmax over the N most frequent words + <unk> (0: all words)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    glosses = read_glosses(args.wordnet_dir)
    vocab = build_vocabulary(glosses)
    output_vocab = len(vocab) if args.output_vocab <= 0 else min(args.output_vocab, len(vocab))
    order = np.random.default_rng(args.seed).permutation(len(glosses))
    held_out = [glosses[i] for i in order[:args.eval_sentences]]
    train = [glosses[i] for i in order[args.eval_sentences:]]
    if args.max_sentences > 0:
        train = train[:args.max_sentences]
    x, y = windows(train, vocab, args.context, output_vocab)
    x_eval, y_eval = windows(held_out, vocab, args.context, output_vocab)
    covered = float(np.mean(y != UNK_ID))

    strategy = make_strategy(args)
    steps = steps_per_epoch(args, len(y), "training data")
    chief_print(strategy,
                f"wordnet glosses: {len(glosses)} ({len(train)} for training, "
                f"{len(held_out)} held out); vocabulary {len(vocab)} words; "
                f"{len(y)} training tokens; softmax over {output_vocab} words "
                f"(covers {covered:.1%} of the targets); {strategy.worker.size} worker(s), "
                f"global batch {args.batch_size}, {steps} steps per epoch")

    data, eval_data, eval_batches = global_batches(args, (x, y), (x_eval, y_eval),
                                                   50_000)

    with strategy.scope():
        model = build_model(len(vocab), output_vocab, args)
        model.compile(optimizer=keras.optimizers.Adam(args.lr),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    report = EpochReport(strategy, args.batch_size, derived=perplexity,
                          log_dir=args.tensorboard)
    model.fit(data, epochs=args.epochs, steps_per_epoch=steps, callbacks=[report],
              shuffle=False, verbose=fit_verbosity(strategy, args))

    extra = {"vocab_size": len(vocab), "output_vocab": output_vocab,
             "train_tokens": int(len(y)), "embedding_rows": len(vocab)}
    if eval_batches > 0:
        local = model.evaluate(eval_data, verbose=0, return_dict=True)["loss"]
        val_loss = float(strategy.reduce(tf.distribute.ReduceOp.SUM,
                                         tf.constant(local, tf.float64), axis=None)) \
            / strategy.num_replicas_in_sync
        extra.update(eval_loss=val_loss, eval_perplexity=math.exp(min(val_loss, 50.0)))
        chief_print(strategy, f"held-out: loss {val_loss:.4f}, perplexity "
                              f"{math.exp(min(val_loss, 50.0)):.1f} "
                              f"({eval_batches * args.batch_size} tokens)")
    print_result(report.result("language_model", args, **extra))


if __name__ == "__main__":
    main()
