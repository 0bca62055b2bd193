"""Token choice for a whole step, on the device: repetition penalty, top-k, top-p, min-p,
temperature and seeded draws, vectorized over rows with per-row parameters.

The logits [B, vocab] never leave the device. The host uploads small per-row tables (parameters,
recent ids), and the B chosen ids come back in one device->host copy, with the logprobs of the
rows that ask for them (muser/logprobs.py: of the raw logits, before any step below).

Per row, in this order (the order of the per-request sampler this replaced):
0. a grammar's mask (muser/grammar.py), for the rows that have one: logits of the tokens it
   does not allow -> -inf, so every later step sees only allowed tokens (greedy included);
   then logit_bias: each (token, bias) pair is added to that token's logit (-inf: never
   chosen), as llama.cpp's first sampler stage does.
1. repetition penalty, llama.cpp's rule: logits of the last repeat_last_n ids of prompt + output
   are divided by the penalty when positive, multiplied by it otherwise; then OpenAI's presence
   and frequency penalties over the tokens generated so far: logit -= frequency * count +
   presence * (count > 0) (with penalties_over_last_n, llama.cpp's: counts over the same last
   repeat_last_n ids as the repetition penalty). Greedy rows get them too.
2. temperature 0 is greedy: torch.argmax of the row, the first index on ties.
3. filters at temperature 1: top-k keeps the k best logits (torch.topk's k); top-p keeps the
   shortest best-first prefix of that list whose softmax mass reaches top_p, and any logit equal
   to its last; min-p keeps the tokens whose probability is at least min_p times the top token's.
4. one draw from softmax(logits / temperature) over the survivors.
A row whose params ask for post_sampling logprobs gets, in place of the raw log-softmax, the log
of softmax(survivors of 3. / temperature) over the logits after 0. and 1. (`post_sampling`;
greedy: its token at log 1 = 0), from a second filter pass over those rows.
A row with a top-k list hashes B x k noise words; a row without one hashes the whole vocabulary
on a GPU (cheap there). On the CPU a top-p row without top-k gets a best-first list just long
enough to hold its survivors (`_top_p_prefix`), not the whole vocabulary sorted, with top-p's
total mass summed over the whole row (its last bits may differ from the sorted list's running
sum a GPU takes; the band sums that size it in C, bands.c), and the draw rules most tokens
out before their logs (noise.c).

Noise. A draw touches no torch.Generator. Token t of a row gets the uniform
    u = ((h >>> 12) + 1/2) / 2**52  in (0, 1),   h = mix(mix(mix(seed) + draw * G) + t * G)
with >>> a logical shift and arithmetic mod 2**64, where mix is splitmix64's finalizer (a
bijection of 64-bit words) and G its odd increment: two nested splitmix64 streams, one step per
draw, one per token id. It is integer math, so a given (seed, draw, token) has the same u on CPU
and CUDA, whatever else shares the batch. (The float steps after it may round differently on the
two in the last bit, which could only matter for two scores equal to ~1e-16: a GPU runs them as
torch ops, the CPU in one C pass with libm's log, muser/ops/native/noise.c.)

Gumbel-max. E_t = -log u_t are independent Exp(1), so E_t / p_t ~ Exp(rate p_t), and the least
of independent exponentials is the one of rate p_t with probability p_t / sum(p). Hence
    argmin_t E_t / p_t  =  argmax_t (log p_t - log E_t)
is an exact draw from p, and p need not be normalized: log p_t = logit_t / temperature + const.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from muser.core import Logprobs, SamplingParams
from muser.grammar import Bitmask
from muser.logprobs import pack, unpack
from muser.ops import native


@dataclass(slots=True)
class SamplingRow:
    """What the engine hands over for each sequence that needs a token this step."""

    params: SamplingParams
    seed: int  # request_seed(params), drawn once per request
    draw: int  # how many tokens the request has drawn before (0 for the first)
    history: list[int]  # prompt + output ids so far; only the last repeat_last_n are read
    outputs: list[int] = field(default_factory=list)  # ids presence/frequency count


def request_seed(params: SamplingParams) -> int:
    """params.seed, else a fresh random 31-bit seed."""
    return params.seed if params.seed is not None else secrets.randbits(31)


class Candidates(NamedTuple):
    """Each row's candidate tokens [B, W]: a best-first top-k list, or the vocabulary in id order;
    pads hold -inf. keep marks the survivors of top-k, top-p and min-p."""

    values: torch.Tensor  # [B, W] float32 logits
    ids: torch.Tensor  # [B, W] int64 token ids
    keep: torch.Tensor  # [B, W] bool


class Choice(NamedTuple):
    tokens: list[int]
    logprobs: list[Logprobs | None]  # per row, None where its params ask for none


class Pending:
    """Tokens chosen on the device, on their way to the host: `tokens` [B] int64 on the device,
    `result()` the Choice once the copy (queued before anything queued after `launch`) lands."""

    def __init__(self, tokens: torch.Tensor, payload: torch.Tensor,
                 ks: list[int | None] | None) -> None:
        self.tokens, self._ks = tokens, ks
        self._host = payload.to("cpu", non_blocking=True)  # NOTE: pinned, from a CUDA device
        self._copied = None
        if payload.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def result(self) -> Choice:
        if self._copied is not None:
            self._copied.synchronize()
        if self._ks is None:
            return Choice(self._host.tolist(), [None] * len(self._host))
        return Choice(*unpack(self._host, self._ks))


class BatchSampler:
    """Chooses one token per row of a step's logits; see the module docstring for the rules."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 bitmask: Bitmask | None = None) -> list[int]:
        """logits [B, vocab] float32 on the device (row b belongs to rows[b]); bitmask: the
        allowed tokens of the constrained rows -> B token ids, with one device->host copy."""
        return self.choose(logits, rows, bitmask).tokens

    def choose(self, logits: torch.Tensor, rows: list[SamplingRow],
               bitmask: Bitmask | None = None) -> Choice:
        """As __call__, and each row's logprobs (muser/logprobs.py: of the raw logits, before
        the grammar's mask too, so asking for them changes no token) in the same copy."""
        return self.launch(logits, rows, bitmask).result()

    def launch(self, logits: torch.Tensor, rows: list[SamplingRow],
               bitmask: Bitmask | None = None) -> Pending:
        """As choose, without waiting: the tokens stay on the device (Pending.tokens) while
        their copy to the host is under way, so the caller may queue more work on the device
        (the next decode step, fed these tokens) before it waits for them."""
        penalized = self.penalize(
            self.constrain(logits, bitmask) if bitmask is not None else logits, rows)
        tokens = self._tokens(penalized, rows)
        ks = [row.params.logprobs for row in rows]
        if all(k is None for k in ks):
            return Pending(tokens, tokens, None)
        k = max(k or 0 for k in ks)
        payload = pack(logits, tokens, k)
        post = [b for b, row in enumerate(rows) if row.params.post_sampling]
        if post:
            index = self._upload(post, torch.int64)
            payload[index] = self.post_sampling(penalized.index_select(0, index),
                                                [rows[b] for b in post], tokens[index], k)
        return Pending(tokens, payload, ks)

    def post_sampling(self, logits: torch.Tensor, rows: list[SamplingRow],
                      tokens: torch.Tensor, k: int) -> torch.Tensor:
        """pack's rows of the distribution each token was drawn from: logits [B, vocab] after
        the mask, biases and penalties, tokens [B] the ids drawn -> [B, 2 + 2k] float64 with
        the log of softmax(survivors / temperature) in place of the raw log-softmax (-inf: not a
        survivor, or a pad where fewer than k survive); a greedy row: its token, log 1 = 0."""
        num_rows = logits.shape[0]
        top = logits.new_full((num_rows, k), float("-inf"), dtype=torch.float64)
        top_ids = torch.zeros(num_rows, k, dtype=torch.int64, device=logits.device)
        chosen = torch.zeros(num_rows, 1, dtype=torch.float64, device=logits.device)
        if k:
            top[:, 0], top_ids[:, 0] = 0.0, tokens
        if not all(row.params.is_greedy for row in rows):
            values, ids, keep = self.filter(logits, rows)
            temperature = self._upload([[row.params.temperature or 1.0] for row in rows],
                                       torch.float64)
            logp = torch.log_softmax(torch.where(keep, values.double() / temperature,
                                                 float("-inf")), -1)
            drawn = torch.where(ids == tokens[:, None], logp, float("-inf")).amax(-1, True)
            v, i = torch.topk(logp, min(k, logp.shape[1]))
            v = F.pad(v, (0, k - v.shape[1]), value=float("-inf"))
            i = F.pad(ids.gather(1, i), (0, k - i.shape[1]))
            greedy = self._upload([[row.params.is_greedy] for row in rows], torch.bool)
            chosen = torch.where(greedy, chosen, drawn)
            top, top_ids = torch.where(greedy, top, v), torch.where(greedy, top_ids, i)
        parts = [tokens[:, None].double(), chosen]
        return torch.cat(parts + ([top, top_ids.double()] if k else []), 1)

    def _tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """[B, vocab] penalized logits -> [B] int64 chosen ids on the device."""
        greedy = [row.params.is_greedy for row in rows]
        if all(greedy):
            return logits.argmax(-1)
        tokens = self.sample(logits, rows)
        if any(greedy):
            tokens = torch.where(self._upload(greedy, torch.bool), logits.argmax(-1), tokens)
        return tokens

    def constrain(self, logits: torch.Tensor, bitmask: Bitmask) -> torch.Tensor:
        """[B, vocab] -> the logits with -inf wherever a constrained row's mask bit is clear
        (token ids past the mask's words: clear)."""
        vocab = logits.shape[1]
        if self.device.type == "cpu":
            # NOTE: numpy unpacks a row in ~40 us, where torch's broadcast shifts take ms here
            octets = bitmask.words.numpy().view(np.uint8)  # little-endian: byte k = 8k..8k+7
            disallowed = torch.from_numpy(np.unpackbits(octets, axis=1, count=vocab,
                                                        bitorder="little")) == 0
        else:  # NOTE: the words travel (32 KiB a row, not 256) and unpack on the device
            disallowed = unpack_bits(self._upload_array(bitmask.words), vocab) == 0
        if bitmask.rows == list(range(logits.shape[0])):
            return logits.masked_fill(disallowed, float("-inf"))
        index = self._upload(bitmask.rows, torch.int64)
        rows = logits.index_select(0, index).masked_fill_(disallowed, float("-inf"))
        return logits.index_copy(0, index, rows)

    def penalize(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """[B, vocab] -> the logits with each row's logit biases, repetition, presence and
        frequency penalties (the same tensor when no row has one)."""
        biases = [row.params.logit_bias for row in rows]
        if any(biases):
            logits = logits + self._biases(logits, biases)
        recent = [row.history[-row.params.repeat_last_n:] if _penalizes(row.params) else []
                  for row in rows]
        if max(map(len, recent)):
            seen = self._counts(logits, recent) > 0  # an id seen twice is penalized once
            penalty = self._upload([[row.params.repeat_penalty] for row in rows], torch.float32)
            penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, penalized, logits)
        outputs = [row.outputs if _counts_outputs(row.params) else [] for row in rows]
        if max(map(len, outputs)):
            counts = self._counts(logits, outputs)
            weights = self._upload([[row.params.frequency_penalty, row.params.presence_penalty]
                                    for row in rows], torch.float32)
            logits = logits - weights[:, :1] * counts - weights[:, 1:] * (counts > 0)
        return logits

    def _biases(self, logits: torch.Tensor,
                biases: list[tuple[tuple[int, float], ...]]) -> torch.Tensor:
        """[B, vocab] float32: each row's biases at their tokens, 0 elsewhere (x + 0 is x)."""
        num_rows, vocab = logits.shape
        width = max(map(len, biases))
        ids = self._upload([[t for t, _ in b] + [vocab] * (width - len(b)) for b in biases],
                           torch.int64)
        values = self._upload([[v for _, v in b] + [0.0] * (width - len(b)) for b in biases],
                              torch.float32)
        table = torch.zeros(num_rows, vocab + 1, dtype=torch.float32, device=logits.device)
        return table.scatter_add_(1, ids, values)[:, :vocab]

    def _counts(self, logits: torch.Tensor, ids: list[list[int]]) -> torch.Tensor:
        """[B, vocab] float32: how often each id occurs in each row's list."""
        num_rows, vocab = logits.shape
        width = max(map(len, ids))
        # NOTE: pads point at an extra column `vocab`, cut off below
        table = self._upload([r + [vocab] * (width - len(r)) for r in ids], torch.int64)
        counts = torch.zeros(num_rows, vocab + 1, dtype=torch.float32, device=logits.device)
        return counts.scatter_add_(1, table, torch.ones_like(table, dtype=torch.float32))[
            :, :vocab]

    def filter(self, logits: torch.Tensor, rows: list[SamplingRow]) -> Candidates:
        """[B, vocab] -> each row's candidates and which of them survive its filters."""
        vocab = logits.shape[1]
        cuts = [_cut(row.params, vocab) for row in rows]
        # the softmax mass top-p measures against: its list's, or the whole row's
        whole = [math.nan] * len(rows)
        if self.device.type == "cpu":  # NOTE: on a GPU the sort is cheap and this would sync
            for b, row in enumerate(rows):
                if cuts[b] == vocab:
                    cuts[b], whole[b] = _top_p_prefix(logits[b], row.params.top_p)
        candidates, num_kept = self._survivors(logits, rows, cuts, whole)
        shortened = [b for b, cut in enumerate(cuts) if cut < vocab and not math.isnan(whole[b])]
        if not shortened:  # NOTE: always so on a GPU, which then reads nothing back
            return candidates
        # A shortened list holds every survivor if the cut fell inside it and its last logit is
        # below the cut's; else (a tie or a rounding at the edge) the row is listed whole.
        values, kept = candidates.values, num_kept.flatten().tolist()
        over = [b for b in shortened
                if not (kept[b] < cuts[b] and values[b, cuts[b] - 1] < values[b, kept[b] - 1])]
        if not over:
            return candidates
        for b in over:
            cuts[b] = vocab
        return self._survivors(logits, rows, cuts, whole)[0]

    def _survivors(self, logits: torch.Tensor, rows: list[SamplingRow], cuts: list[int],
                   whole: list[float]) -> tuple[Candidates, torch.Tensor | None]:
        """filter for given list lengths and top-p totals (NaN: the list's) -> the candidates,
        and each row's count of top-p's best-first prefix [B, 1] (None: no row has top-p)."""
        values, ids = self._lists(logits, cuts)
        limits = self._upload([[row.params.top_p, row.params.min_p, w]
                               for row, w in zip(rows, whole, strict=True)], torch.float64)
        top_p, min_p, total = limits[:, :1], limits[:, 1:2], limits[:, 2:]
        relative = torch.exp(values - values.amax(-1, keepdim=True))  # p / p_top; pads -> 0
        keep = (relative >= min_p) & (values > float("-inf"))
        num_kept = None
        if any(row.params.top_p < 1 and not row.params.is_greedy for row in rows):
            # NOTE: cut at a value, not a position, so equal logits stay or go together and the
            # survivors do not depend on how a sort ordered them.
            mass = relative.double().cumsum(-1)
            before = F.pad(mass[:, :-1], (1, 0))
            total = torch.where(total.isnan(), mass[:, -1:], total)
            num_kept = (before < top_p * total).sum(-1, keepdim=True).clamp_(min=1)
            floor = values.gather(1, num_kept - 1).masked_fill(top_p >= 1, float("-inf"))
            keep &= values >= floor
        return Candidates(values, ids, keep), num_kept

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """[B, vocab] -> [B] int64 drawn token ids on the device (greedy rows: meaningless)."""
        values, ids, keep = self.filter(logits, rows)
        counters = self._upload([[_int64(row.seed), row.draw] for row in rows], torch.int64)
        temperature = self._upload([[row.params.temperature or 1.0] for row in rows],
                                   torch.float64)
        keys = draw_keys(counters[:, 0], counters[:, 1])
        # NOTE: on the CPU one C pass with no [B, W] temporaries, the same draw
        draw = native.gumbel_argmax if self.device.type == "cpu" else gumbel_argmax
        return draw(values, ids, keep, keys, temperature[:, 0])

    def _lists(self, logits: torch.Tensor, cuts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> values, ids [B, W]: row b holds torch.topk(row, cuts[b]) (cut 0: the vocabulary in id
        order; cut -1, a greedy row: whatever the others hold, or pads)."""
        num_rows, vocab = logits.shape
        wanted = {cut for cut in cuts if cut >= 0} or {0}

        def listing(cut: int) -> tuple[torch.Tensor, torch.Tensor]:
            if cut == 0:
                return logits, torch.arange(vocab, device=logits.device).expand(num_rows, vocab)
            return tuple(torch.topk(logits, cut))

        if len(wanted) == 1:
            return listing(wanted.pop())
        # NOTE: one torch.topk per distinct k, so a row's list is topk(row, its own k) whatever
        # else shares the batch (under ties, a wider k could pick other equal logits).
        width = vocab if 0 in wanted else max(wanted)
        code = self._upload(cuts, torch.int64)[:, None]
        values = logits.new_full((num_rows, width), float("-inf"))
        ids = torch.zeros(num_rows, width, dtype=torch.int64, device=logits.device)
        for cut in wanted:
            v, i = listing(cut)
            pad = width - v.shape[1]
            values = torch.where(code == cut, F.pad(v, (0, pad), value=float("-inf")), values)
            ids = torch.where(code == cut, F.pad(i, (0, pad)), ids)
        return values, ids

    def _upload(self, table: list, dtype: torch.dtype) -> torch.Tensor:
        return self._upload_array(torch.tensor(table, dtype=dtype))

    def _upload_array(self, host: torch.Tensor | np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(host) if isinstance(host, np.ndarray) else host
        if self.device.type == "cuda":
            # NOTE: pinned + non_blocking: the copy queues behind the forward pass instead of
            # waiting for it; the caching host allocator keeps the buffer until it is done.
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)


def unpack_bits(words: torch.Tensor, count: int) -> torch.Tensor:
    """[R, W] int32 words -> [R, count] uint8 bits, bit j % 32 of word j // 32 for column j
    (an arithmetic shift copies the sign bit, and & 1 keeps only the bit shifted down)."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts).bitwise_and_(1).to(torch.uint8)
    return bits.view(words.shape[0], -1)[:, :count]


def _penalizes(p: SamplingParams) -> bool:
    return p.repeat_penalty != 1.0 and p.repeat_last_n > 0


def _counts_outputs(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _top_p_prefix(row: torch.Tensor, top_p: float) -> tuple[int, float]:
    """A top-p row without top-k, on the CPU: the length of a best-first list (torch.topk's)
    that should hold every survivor and one token past them (filter checks that it does), and
    the row's softmax mass as filter measures it (relative to the top logit, float64). Sorting
    the whole vocabulary costs tens of milliseconds a row there; the survivors are usually a
    few hundred tokens.

    The mass per power-of-two band of p / p_top, summed from the top band down, says how many
    tokens reach top_p; the list holds that many plus one, rounded up to a power of two so that
    rows share lists."""
    vocab = row.numel()
    relative = torch.exp(row - row.amax())  # filter's p / p_top, element for element
    total = float(relative.double().sum())
    mass, count = native.top_p_bands(relative)  # NOTE: one C pass, not two bincounts
    reach = int(torch.searchsorted(mass.cumsum(0),
                                   torch.tensor([top_p * total], dtype=torch.float64)))
    listed = int(count[:reach + 1].sum()) + 1
    return min(vocab, max(256, 1 << (listed - 1).bit_length())), total


def top_p_bands(relative: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """relative [V] float32 p / p_top in [0, 1] -> the mass [127] float64 and count [127]
    int64 of each power-of-two band: band b holds [2^-(b+1), 2^-b) (1 in band 0), 126 less
    float32's biased exponent; the last band, 126, holds the subnormals and zeros. The CPU runs
    native.top_p_bands, the same sums in one pass."""
    band = (126 - (relative.view(torch.int32) >> 23)).clamp_(min=0)
    return (torch.bincount(band, relative.double(), minlength=127),
            torch.bincount(band, minlength=127))


def _cut(p: SamplingParams, vocab: int) -> int:
    """The length of a row's best-first candidate list: top_k, the whole vocabulary when only
    top-p needs a sort, 0 for no sort at all (the vocabulary in id order), -1 for greedy."""
    if p.is_greedy:
        return -1
    if 0 < p.top_k < vocab:
        return p.top_k
    return vocab if p.top_p < 1 else 0


_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64's constants, as signed int64
_MUL1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MUL2 = 0x94D049BB133111EB - (1 << 64)


def _int64(x: int) -> int:
    """Any Python int -> the int64 with the same low 64 bits."""
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's >> is arithmetic: mask the sign copies)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 words; torch's int64 products wrap mod 2**64 like its."""
    x = (x ^ _shr(x, 30)) * _MUL1
    x = (x ^ _shr(x, 27)) * _MUL2
    return x ^ _shr(x, 31)


def draw_keys(seeds: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """seeds, draws [B] int64 -> each row's key [B] int64 for this draw."""
    return _mix(_mix(seeds) + draws * _GAMMA)


def uniform(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """keys [B] int64 (draw_keys), ids [B, W] int64 -> [B, W] float64 in (0, 1), a pure
    function of (seed, draw, token id)."""
    return (_shr(_mix(keys[:, None] + ids * _GAMMA), 12).double() + 0.5) * 2.0**-52


def gumbel_argmax(values: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor,
                  keys: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """values [B, W] float32, ids [B, W] int64, keep [B, W] bool, keys [B] int64, temperature
    [B] float64 -> [B] int64: each row's id of the largest kept value / temperature + Gumbel
    noise -log(-log u) (the first on ties). The torch ops run on a GPU; the CPU runs
    native.gumbel_argmax, the same draw in one pass."""
    noise = -torch.log(-torch.log(uniform(keys, ids)))
    scores = torch.where(keep, values.double() / temperature[:, None] + noise, float("-inf"))
    return ids.gather(1, scores.argmax(-1, keepdim=True)).squeeze(1)
