"""Write the parity golden files in tests/data/golden/ (read by tests/test_parity.py).

For every prompt below:
  * llama.cpp (llama-cpp-python): the prompt's token ids (BOS added, special tokens parsed),
    its 32 greedy tokens, and the top-5 logits (ids + values) before each greedy step;
  * transformers (GGUF dequantized to float32): the logits at the last prompt position, run on
    llama.cpp's prompt ids.

Output:
  <out>/meta.json            versions, model sha256, the prompt names in order, storage notes
  <out>/<name>.json          per prompt: text, prompt_ids, greedy_ids, top5 (one per step)
  <out>/transformers_logits.npz
      <name>__top_ids    int32   [2048]  ids of transformers' 2048 largest logits (descending)
      <name>__top_vals   float32 [2048]  their exact float32 values
      <name>__q          int16   [vocab] every logit as round((x - offset) / step)
      <name>__offset, <name>__step  float64 scalars; x ~= offset + step * q

Storage choice: full float32 logits are 1 MiB per prompt and barely compress (float mantissas
are noise to zlib), so the 15 prompts would put ~15 MB in git. Instead the whole vocabulary is
stored as int16 fixed point with a per-prompt step (logit range / 65000, about 6e-4 for this
model), so every dequantized logit is within step / 2 (<= 4.4e-4 measured, recorded per prompt
as `max_quant_error`) of transformers' float32 value: under 1% of the test's 0.05 bound. The
top 2048 (top-1 and the bulk of the probability mass) are also kept exactly as float32. The
int16 planes are near their entropy (~15 bits a logit), so the npz is ~7.8 MB.

llama-cpp-python, transformers and accelerate are optional reference tools; the default test
run never imports them. Usage:

    python scripts/make_golden.py --out tests/data/golden
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

N_STEPS = 32
TOP_K = 5
TOP_EXACT = 2048

# --- Varied natural text for the long prompts (each paragraph on its own topic). -------------

PARAGRAPHS = [
    ("The first lighthouses were not towers at all but fires kept burning on hilltops, tended "
     "by villagers who were paid in grain or fish for every night they stayed awake. The Pharos "
     "of Alexandria changed that idea for good: a stone tower more than a hundred metres tall, "
     "with a fire at the top and, according to later writers, a polished bronze mirror that "
     "threw its light far out over the water. For centuries afterwards, harbour towns copied "
     "the design, and the word for lighthouse in several European languages still echoes its "
     "name."),
    ("Baking bread at home is mostly a lesson in patience. Flour, water, salt and yeast are "
     "cheap, but the dough needs time to develop gluten and flavour, and no amount of kneading "
     "can fully replace a slow, cool rise overnight in the refrigerator. Experienced bakers "
     "watch the dough rather than the clock: when a floured finger leaves a dent that springs "
     "back slowly, the loaf is ready for the oven. A tray of boiling water on the lowest shelf "
     "gives the crust its shine."),
    ("In the spring the river rises quickly, carrying silt from the mountains into the wide "
     "valley below. Willows along the banks slow the current and trap the sediment, and within "
     "a few years a gravel bar can become an island covered with young trees. Herons hunt in the "
     "shallow side channels, where small fish shelter from the main flow, and beavers build "
     "dams that turn a single stream into a chain of quiet ponds. Ecologists call such a river "
     "braided, because its channels split and join again like strands of hair."),
    ("Marta had not been back to the village for eleven years. The bus dropped her at the "
     "square, which seemed smaller than she remembered, and the bakery on the corner had become "
     "a pharmacy with a green cross blinking above the door. She pulled her suitcase over the "
     "cobblestones toward her grandmother's house, rehearsing what she would say, and stopped "
     "when she saw that the blue shutters had been painted white. Someone was sweeping the "
     "steps. It took her a moment to recognise her younger brother."),
    ("TCP congestion control tries to answer a simple question: how fast may a sender transmit "
     "without overwhelming the network between itself and the receiver? The classic answer is "
     "additive increase, multiplicative decrease. The sender grows its congestion window by "
     "roughly one segment per round trip while acknowledgements arrive, and halves it when a "
     "loss suggests that some queue along the path has overflowed. Newer algorithms such as "
     "CUBIC and BBR estimate the available bandwidth and the minimum round-trip time directly."),
    ("Jupiter has at least ninety-five known moons, but four of them dominate every "
     "description of the system. Io is the most volcanically active body in the solar system, "
     "heated by tides as it is squeezed between Jupiter and its neighbours. Europa hides an "
     "ocean of salty water beneath a cracked shell of ice, which makes it one of the most "
     "promising places to search for life. Ganymede is larger than the planet Mercury, and "
     "Callisto's ancient surface is covered with craters from edge to edge."),
    ("Dear Mr. Okafor, thank you for your letter of the twelfth and for the samples you sent "
     "with it. Our team tested the fabric under the conditions you described and found that it "
     "keeps its colour after fifty washes at forty degrees, although it shrinks by nearly two "
     "percent along the warp. We would like to place a trial order of three hundred metres, "
     "provided that the shrinkage can be reduced before delivery. Please let us know whether "
     "the first week of March would suit your workshop."),
    ("A major scale is built from a pattern of whole and half steps: whole, whole, half, whole, "
     "whole, whole, half. Starting that pattern on C gives the white keys of the piano, which is "
     "why C major is usually the first key a student learns. Chords are stacked from every other "
     "note of the scale, so the chord on the first degree contains C, E and G, while the chord "
     "on the fifth degree, G, B and D, pulls strongly back toward the tonic. That pull is the "
     "engine of most Western harmony."),
    ("When prices rise across an economy, each unit of money buys a little less than it did "
     "before. Moderate inflation is not necessarily harmful, and many central banks aim for "
     "about two percent a year, because a small positive rate gives them room to cut interest "
     "rates during a downturn. Trouble begins when people expect prices to keep climbing faster: "
     "workers demand higher wages, firms raise prices to cover those wages, and the expectation "
     "becomes self-fulfilling unless policy makers act firmly."),
    ("To repot a houseplant, water it the day before so that the root ball slides out of the "
     "old container in one piece. Choose a new pot only a few centimetres wider, with a drainage "
     "hole, and cover the bottom with fresh potting mix. Loosen any roots that circle the "
     "outside of the ball, set the plant at the same depth as before, and fill the gaps with mix, "
     "pressing gently. Water thoroughly and keep the plant out of direct sun for a week while it "
     "recovers."),
    ("Day four. We left the hostel before dawn and reached the pass just as the sun cleared the "
     "ridge, turning the snowfields pink and then gold. The path down the far side was steeper "
     "than the map suggested, all loose scree and switchbacks, and Tomas slipped twice but only "
     "bruised his pride. By noon we were eating bread and hard cheese beside a lake so clear that "
     "we could count the stones on the bottom. Tonight we sleep in a shepherd's hut that smells "
     "of smoke and wool."),
    ("Photosynthesis happens in two linked stages. In the light-dependent reactions, which take "
     "place in the thylakoid membranes of the chloroplast, energy from sunlight splits water "
     "molecules, releasing oxygen and producing the energy carriers ATP and NADPH. In the Calvin "
     "cycle, which runs in the surrounding stroma, the plant uses those carriers to fix carbon "
     "dioxide from the air into three-carbon sugars. Those sugars become glucose, starch and "
     "cellulose, the raw material of nearly every food chain on land."),
    ("The tenant shall keep the premises in good repair and shall not make structural changes "
     "without the prior written consent of the landlord, which shall not be unreasonably "
     "withheld. Rent is payable monthly in advance on the first day of each month. If any "
     "payment is more than fourteen days late, the landlord may charge interest at the rate set "
     "out in the schedule. Either party may end this agreement by giving the other not less "
     "than two months' notice in writing."),
    ("\"Are you sure this is the right platform?\" asked the old man, peering at the board. "
     "\"Quite sure,\" said the girl beside him. \"The train to the coast always leaves from "
     "platform nine on Sundays, because they repair the tracks on the other side.\" He thanked "
     "her and sat down on his suitcase. \"My wife used to know all these things,\" he said after "
     "a while. \"She kept the timetables in a drawer in the kitchen, and she never once let us "
     "miss a train.\""),
    ("Glaciers move because ice, under enough pressure, behaves like a very slow liquid. At the "
     "base of a glacier, meltwater can lubricate the bed so that the whole mass slides forward, "
     "sometimes by several metres in a single day during a surge. As it travels, the ice plucks "
     "rocks from the valley floor and drags them along, grinding the bedrock into fine powder "
     "that turns meltwater streams a milky turquoise. The U-shaped valleys of the Alps and of "
     "Norway are the signatures of ice that has since retreated."),
    ("The committee met on Thursday to review the budget for the new library wing. The "
     "architect presented revised drawings that reduce the glass area on the south side, which "
     "should lower cooling costs in summer, and the treasurer confirmed that a grant from the "
     "regional council will cover about a third of construction. Several members asked whether "
     "the children's section could be moved to the ground floor; the architect agreed to study "
     "the idea and report back at the next meeting."),
]

CODE_SNIPPET = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals; the result is sorted."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


print(merge_intervals([[1, 3], [2, 6], [8, 10], [15, 18]]))
'''

MULTILINGUAL_BLOCK = (
    "Ein kurzer Absatz auf Deutsch: Die Stadtbibliothek öffnet am Montag wieder, nachdem das "
    "Dach im Winter repariert wurde. Un paragraphe en français : les élèves ont planté des "
    "arbres fruitiers derrière l'école. Un párrafo en español: el mercado de los sábados vende "
    "queso, miel y pan recién hecho."
)


def _paras(*indices: int) -> str:
    return "\n\n".join(PARAGRAPHS[i] for i in indices)


LONG_600 = (
    _paras(0, 1, 2, 3) + "\n\n" + _paras(4, 14)
    + "\n\nQuestion: Which of the paragraphs above describes a journey home? Answer:"
)
LONG_1100 = (
    "<start_of_turn>user\nRead these notes and summarise each in one sentence.\n\n"
    + _paras(5, 6, 7, 8, 9, 12) + "\n\n" + CODE_SNIPPET + "\n" + _paras(10, 11, 13, 15)
    + "<end_of_turn>\n<start_of_turn>model\n"
)
LONG_1700 = (
    _paras(12, 13, 14, 15, 0, 2) + "\n\n" + MULTILINGUAL_BLOCK + "\n\n"
    + _paras(4, 6, 8, 10, 11, 1, 3, 5, 7, 9) + "\n\nThe common thread in all of these passages is"
)

PROMPTS: dict[str, str] = {
    "bos_only": "",
    "single_token": "Hi",
    "english_short": "The capital of France is",
    "english_sentence": "Once upon a time, in a small village at the edge of a great forest, there "
                        "lived a",
    "code_python": "def fibonacci(n: int) -> int:\n"
                   "    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "chat": "<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n"
            "<start_of_turn>model\n",
    "chinese": "我爱自然语言处理。今天天气很好，我们去公园散步吧！明天",
    "japanese": "日本の首都は東京です。京都は昔の首都で、",
    "russian": "Москва — столица России. Самая длинная река в Европе —",
    "arabic": "اللغة العربية هي إحدى أكثر اللغات انتشاراً في العالم، ويتحدث بها",
    "emoji": "I love pizza 🍕🍕! Today's mood: 😀😂🎉 and my favourite animal is 🐈 because",
    "numbers": "1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144,",
    "long_600": LONG_600,
    "long_1100": LONG_1100,
    "long_1700": LONG_1700,
}


def log(msg: str) -> None:
    print(f"[make_golden {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def llama_cpp_run(llm, text: str) -> dict:
    """Prompt ids, greedy ids and the top-5 logits before each greedy step, via llama.cpp."""
    ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
    llm.reset()
    llm.eval(ids)
    greedy, top = [], []
    for step in range(N_STEPS):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        order = np.argsort(-row, kind="stable")[:TOP_K]
        top.append({"ids": [int(i) for i in order], "logits": [float(row[i]) for i in order]})
        greedy.append(int(order[0]))
        if step + 1 < N_STEPS:
            llm.eval([greedy[-1]])
    return {"prompt_ids": [int(i) for i in ids], "greedy_ids": greedy, "top5": top}


def dump_record(record: dict) -> str:
    """JSON with one key per line and one top-5 step per line (diff-friendly, compact)."""
    def value(key: str, v) -> str:
        if key == "top5":
            return "[\n" + ",\n".join("  " + json.dumps(t) for t in v) + "\n ]"
        return json.dumps(v, ensure_ascii=False)

    body = ",\n".join(f" {json.dumps(k)}: {value(k, v)}" for k, v in record.items())
    return "{\n" + body + "\n}\n"


def quantize(logits: np.ndarray) -> tuple[np.ndarray, float, float, float]:
    """float32 [V] -> (int16 q, offset, step, max |dequantized - logits|)."""
    lo, hi = float(logits.min()), float(logits.max())
    offset = (lo + hi) / 2
    step = max(hi - lo, 1e-6) / 65000
    q = np.round((logits.astype(np.float64) - offset) / step)
    assert q.min() >= -32768 and q.max() <= 32767
    q = q.astype(np.int16)
    err = float(np.abs(offset + step * q.astype(np.float64) - logits.astype(np.float64)).max())
    return q, offset, step, err


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("tests/data/golden"),
                        help="output folder (default: tests/data/golden)")
    parser.add_argument("--model", type=Path, default=None,
                        help="GGUF path (default: the embedded Gemma 3 270M Q4_K_M)")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp and torch threads")
    parser.add_argument("--only", nargs="*", default=None,
                        help="only these prompts (a partial golden set: use another --out)")
    args = parser.parse_args()

    import llama_cpp
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if args.model is None:
        from muser.loading.default_model import default_model_path
        args.model = default_model_path()
    model_path = args.model.resolve()
    names = args.only or list(PROMPTS)
    args.out.mkdir(parents=True, exist_ok=True)

    log(f"llama.cpp: loading {model_path}")
    llm = llama_cpp.Llama(str(model_path), n_ctx=4096, logits_all=True, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False)
    results: dict[str, dict] = {}
    for name in names:
        t0 = time.time()
        results[name] = llama_cpp_run(llm, PROMPTS[name])
        log(f"llama.cpp {name}: {len(results[name]['prompt_ids'])} prompt tokens, greedy "
            f"{N_STEPS} in {time.time() - t0:.1f}s: "
            f"{llm.detokenize(results[name]['greedy_ids']).decode('utf-8', 'replace')!r}")
    del llm

    log("transformers: loading the GGUF dequantized to float32")
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32
    ).eval()
    arrays: dict[str, np.ndarray] = {}
    for name in names:
        t0 = time.time()
        ids = torch.tensor([results[name]["prompt_ids"]])
        with torch.no_grad():
            logits = model(ids, logits_to_keep=1).logits[0, -1].float().numpy()
        top_ids = np.argsort(-logits, kind="stable")[:TOP_EXACT].astype(np.int32)
        q, offset, step, err = quantize(logits)
        arrays[f"{name}__top_ids"] = top_ids
        arrays[f"{name}__top_vals"] = logits[top_ids].astype(np.float32)
        arrays[f"{name}__q"] = q
        arrays[f"{name}__offset"] = np.float64(offset)
        arrays[f"{name}__step"] = np.float64(step)
        results[name]["transformers_top1"] = int(top_ids[0])
        results[name]["max_quant_error"] = err
        llama_top = results[name]["top5"][0]
        log(f"transformers {name}: {time.time() - t0:.1f}s, top-1 {top_ids[0]} "
            f"({logits[top_ids[0]]:.3f}) vs llama.cpp {llama_top['ids'][0]} "
            f"({llama_top['logits'][0]:.3f}), quantization error {err:.2e}")

    for name in names:
        record = {"name": name, "text": PROMPTS[name], **results[name]}
        (args.out / f"{name}.json").write_text(dump_record(record), "utf-8")
    npz = args.out / "transformers_logits.npz"
    np.savez_compressed(npz, **arrays)
    meta = {
        "model": model_path.name,
        "model_sha256": sha256_of(model_path),
        "llama_cpp_python": llama_cpp.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "n_steps": N_STEPS,
        "top_k": TOP_K,
        "top_exact": TOP_EXACT,
        "prompts": names,
        "llama_cpp_settings": {"n_ctx": 4096, "logits_all": True, "n_threads": args.threads,
                               "tokenize": "add_bos=True, special=True"},
        "transformers_settings": "AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, "
                                 "dtype=torch.float32); logits at the last prompt position",
        "storage": "transformers_logits.npz: per prompt the 2048 largest logits exactly "
                   "(float32) and all logits as int16 fixed point: offset + step * q, "
                   "|error| <= max_quant_error (in each prompt's JSON)",
    }
    (args.out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", "utf-8")
    log(f"wrote {len(names)} prompts to {args.out} ({npz.stat().st_size / 1e6:.2f} MB npz)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
