"""The CacheBlend benchmark's data: a corpus this machine has, its tokenizer, and RAG prompts.

Why this file exists: blending quality is only measurable on a model that needs attention
across documents, and on prompts shaped like retrieval-augmented generation. The training
script (benchmarks/blend/train_blend_model.py) and the benchmark (benchmarks/blend/
bench_blend.py) both build their prompts here, so the model is evaluated on the
distribution it was trained on.

The text is Python's own documentation, `pydoc_data.topics.topics` (shipped with every
CPython, no download). Its topics are split by name into a training and a held-out part,
each one token stream. A RAG "document" is a chunk of that stream, as a retriever cuts a
long text into chunks: consecutive chunks continue each other's text. Synthetic facts are
spliced into the chunks as lines of token ids:

    fact      key_17 val_3 val_40 ;\\n      (the value of a key is two value tokens)
    reference key_52 key_17 ;\\n            (key_52's value is key_17's: 2 hops; the fact
                                            is always in an earlier chunk)

A prompt is `<bos> system <sep> chunk <sep> ... chunk <sep>` and a last segment that is
never cached. The system prompt is the same in every prompt (the only part prefix caching
can reuse); chunks are stored alone, from position 0, and found wherever they appear (the
part only blending can reuse). The prompt's chunks are a few unrelated chunks followed by a
run of consecutive ones, and its last segment is one of:

- "continue": the first tokens of the chunk that follows the run. Predicting them needs
  the previous chunk's context, across the <sep>, which a chunk computed alone lacks;
- "fact": `\\n? key` followed by the key's two values (retrieval across chunks).

`<sep>` is a dedicated special token that never occurs in text: it is the `spt_token_id`
that splits the prompt into segments (LMCache issue #1136: never split on a re-tokenized
string).
"""

import dataclasses
import hashlib
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<bos>", "<eos>", "<sep>")
NUM_KEYS = 96
NUM_VALUES = 96
VOCAB_SIZE = 2048  # BPE merges + specials + the key_* / val_* tokens
SYSTEM_PROMPT = "Answer each question from the documents below, following references.\n"
CHUNK_TOKENS = (24, 48)  # pydoc tokens per chunk (min, max), facts not counted
CONTINUE_TOKENS = 16  # answer tokens of a "continue" prompt
HELD_OUT_EVERY = 8  # every 8th topic (sorted by name) is held out of training


def corpus_topics() -> dict[str, str]:
    """Python's pydoc topics, `{name: text}` (79 topics, ~465k characters on CPython 3.11)."""
    from pydoc_data.topics import topics

    return dict(sorted(topics.items()))


def corpus_digest() -> str:
    """sha256 (hex) of the corpus text: it differs between Python versions, so cached
    weights are keyed by it."""
    digest = hashlib.sha256()
    for name, text in corpus_topics().items():
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    return digest.hexdigest()


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer of VOCAB_SIZE ids trained on the pydoc topics.

    Ids 0, 1, 2 are `<bos>`, `<eos>`, `<sep>`; the last NUM_KEYS + NUM_VALUES ids are the
    added tokens `key_<i>` and `val_<i>` of the synthetic facts. Deterministic for a
    given corpus (the BPE trainer breaks ties by order).
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - NUM_KEYS - NUM_VALUES, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(list(corpus_topics().values()), trainer)
    tokenizer.add_tokens([f"key_{i}" for i in range(NUM_KEYS)]
                         + [f"val_{i}" for i in range(NUM_VALUES)])
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, "tokenizer size changed: a bug"
    return tokenizer


@dataclasses.dataclass
class Chunk:
    """A document: a chunk of pydoc text with fact / reference lines spliced in.

    Attributes:
        ids: the chunk's token ids, ending with `<sep>`.
        text: the pydoc tokens alone (what a "continue" answer is cut from).
        facts: `{key: (value, value)}`; refs: `{key: referenced key}`.
    """

    ids: list[int]
    text: list[int]
    facts: dict[int, tuple[int, int]]
    refs: dict[int, int]


@dataclasses.dataclass
class Prompt:
    """One RAG prompt and its expected answer.

    Attributes:
        input_ids: `<bos> system <sep> chunk <sep> ... chunk <sep> [last segment]`.
        answer_ids: the tokens after the prompt (teacher-forced answer positions).
        kind: "continue" or "fact".
        hops: 1 or 2 for "fact" prompts, 0 for "continue".
        num_scored: leading answer tokens whose argmax decides accuracy (2 values for
            "fact", every token for "continue").
        chunk_ids: which pool chunks, in prompt order.
    """

    input_ids: list[int]
    answer_ids: list[int]
    kind: str
    hops: int
    num_scored: int
    chunk_ids: list[int]


class BlendTask:
    """Builds chunks, prompts and training sequences from the tokenized corpus.

    Args:
        tokenizer: from `train_tokenizer` (or loaded from its tokenizer.json).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        ids = tokenizer.token_to_id
        self.bos_id, self.eos_id, self.sep_id = (ids(t) for t in SPECIAL_TOKENS)
        self.key_ids = [ids(f"key_{i}") for i in range(NUM_KEYS)]
        self.value_ids = [ids(f"val_{i}") for i in range(NUM_VALUES)]
        self._end = tokenizer.encode(";\n").ids
        self._query = tokenizer.encode("\n?").ids
        # <bos> system <sep>: the first segment of every prompt.
        self.system_ids = [self.bos_id, *tokenizer.encode(SYSTEM_PROMPT).ids, self.sep_id]
        names, texts = list(corpus_topics()), corpus_topics()
        self._streams = {}
        for split in ("train", "held_out"):
            chosen = [n for i, n in enumerate(names)
                      if (i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) == (split == "held_out")]
            self._streams[split] = [t for n in chosen
                                    for t in tokenizer.encode(texts[n] + "\n\n").ids]

    def num_text_tokens(self, split: str) -> int:
        """Tokens of pydoc text in `split` ("train" or "held_out")."""
        return len(self._streams[split])

    def text(self, rng: random.Random, num_tokens: int, split: str) -> list[int]:
        """A window of `num_tokens` consecutive pydoc tokens of `split` (no special token)."""
        stream = self._streams[split]
        start = rng.randrange(len(stream) - num_tokens)
        return stream[start:start + num_tokens]

    def fact_line(self, key: int, values: tuple[int, int]) -> list[int]:
        return [key, *values, *self._end]

    def ref_line(self, key: int, target: int) -> list[int]:
        return [key, target, *self._end]

    def question(self, key: int, values: tuple[int, int]) -> tuple[list[int], list[int]]:
        """(question ids `\\n? key`, answer ids `v1 v2 ; \\n`)."""
        return [*self._query, key], [*values, *self._end]

    def chunks(self, rng: random.Random, num_chunks: int, split: str) -> list[Chunk]:
        """`num_chunks` consecutive chunks of one window of `split`, with 1-2 facts each
        and, in most chunks after the first, a reference to a fact of an earlier chunk.
        Keys are distinct within the returned chunks (at most ~40 chunks)."""
        sizes = [rng.randint(*CHUNK_TOKENS) for _ in range(num_chunks)]
        window = self.text(rng, sum(sizes), split)
        keys = rng.sample(self.key_ids, len(self.key_ids))
        out, earlier, start = [], [], 0
        for size in sizes:
            body = window[start:start + size]
            start += size
            facts = {keys.pop(): (rng.choice(self.value_ids), rng.choice(self.value_ids))
                     for _ in range(rng.randint(1, 2))}
            lines = [self.fact_line(k, v) for k, v in facts.items()]
            refs = {keys.pop(): rng.choice(earlier)} if earlier and rng.random() < 0.7 else {}
            lines += [self.ref_line(k, t) for k, t in refs.items()]
            rng.shuffle(lines)
            cuts = sorted(rng.randrange(len(body) + 1) for _ in lines)
            ids, last = [], 0
            for cut, line in zip(cuts, lines):
                ids += body[last:cut] + line
                last = cut
            out.append(Chunk(ids + body[last:] + [self.sep_id], body, facts, refs))
            earlier += list(facts)
        return out

    def fact_questions(self, chunks: list[Chunk]) -> list[tuple[int, tuple[int, int], int]]:
        """`(key, values, hops)` of every question these chunks, in this order, answer: each
        fact, and each reference whose fact is in an earlier chunk of the list."""
        position = {k: i for i, c in enumerate(chunks) for k in c.facts}
        values = {k: v for c in chunks for k, v in c.facts.items()}
        out = [(k, v, 1) for c in chunks for k, v in c.facts.items()]
        out += [(k, values[t], 2) for i, c in enumerate(chunks) for k, t in c.refs.items()
                if position.get(t, i) < i]
        return out

    def arrange(self, rng: random.Random, num_chunks: int, pool_size: int) -> tuple[list[int], int]:
        """Which pool chunks a prompt holds: 0-2 unrelated chunks, then a run of consecutive
        ones; and the index of the chunk after the run (its text is the "continue" answer).

        Returns:
            (chunk indices in prompt order, index of the next chunk).
        """
        run = rng.randint(2, num_chunks)
        first = rng.randrange(pool_size - run)
        others = [i for i in range(pool_size) if not first <= i <= first + run]
        return rng.sample(others, num_chunks - run) + list(range(first, first + run)), first + run

    def prompt(self, rng: random.Random, pool: list[Chunk], kind: str, hops: int = 1,
               num_chunks: tuple[int, int] = (4, 6)) -> Prompt | None:
        """A prompt over pool chunks (see `arrange`); None when `kind` "fact" with `hops`
        has no question in the chosen chunks."""
        order, following = self.arrange(rng, rng.randint(*num_chunks), len(pool))
        chosen = [pool[i] for i in order]
        body = self.system_ids + [t for c in chosen for t in c.ids]
        if kind == "continue":
            answer = pool[following].text[:CONTINUE_TOKENS]
            return Prompt(body + answer[:1], answer[1:], "continue", 0, len(answer) - 1, order)
        questions = [q for q in self.fact_questions(chosen) if q[2] == hops]
        if not questions:
            return None
        key, values, hops = rng.choice(questions)
        question, answer = self.question(key, values)
        return Prompt(body + question, answer, "fact", hops, 2, order)

    def prompts(self, rng: random.Random, pool: list[Chunk], num_prompts: int) -> list[Prompt]:
        """`num_prompts` prompts over `pool`, kinds in turn: continue, 1-hop fact, continue,
        2-hop fact, ... A chunk appears at different offsets in different prompts."""
        out: list[Prompt] = []
        while len(out) < num_prompts:
            turn = len(out) % 4
            prompt = self.prompt(rng, pool, "continue" if turn % 2 == 0 else "fact",
                                 hops=1 if turn == 1 else 2)
            if prompt is not None:
                out.append(prompt)
        return out

    def training_example(self, rng: random.Random, split: str = "train",
                         num_questions: int = 6) -> tuple[list[int], list[int]]:
        """One training sequence shaped like a prompt, with both kinds of last segment.

        Returns:
            (ids, is_answer): `<bos> system <sep> chunks... continuation (\\n? key v v ;\\n)
            x num_questions <eos>`, and per id 1 where the token is a fact's value in an
            answer (0 elsewhere).
        """
        pool = self.chunks(rng, 12, split)
        order, following = self.arrange(rng, rng.randint(4, 6), len(pool))
        chosen = [pool[i] for i in order]
        ids = self.system_ids + [t for c in chosen for t in c.ids]
        ids += pool[following].text[:rng.randint(CONTINUE_TOKENS, 2 * CONTINUE_TOKENS)]
        is_answer = [0] * len(ids)
        questions = self.fact_questions(chosen)
        for key, values, _ in rng.sample(questions, min(num_questions, len(questions))):
            question, answer = self.question(key, values)
            ids += question + answer
            is_answer += [0] * len(question) + [1, 1] + [0] * (len(answer) - 2)
        return ids + [self.eos_id], is_answer + [0]
