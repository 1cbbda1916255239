"""A Hugging Face Trainer fine-tune to run under jobgen as the job's own program (README: "Your own
training script"): a causal LM on a JSON Lines file of {"text": ...} records (or a JSON list; chat
records' "messages"/"conversations" turns are joined into one text).

    python finetune.py --model_name_or_path MODEL --data_path train.jsonl --output_dir output [TrainingArguments...]

jobgen-torchrun starts it on every rank; JobgenCallback saves checkpoint-N and ends training when
jobgen stops the job, and jobgen passes --resume_from_checkpoint at the next start. On a CPU job
(gpus_per_node: 0) jobgen sets ACCELERATE_USE_CPU, so the ranks train as one data-parallel run
(gloo) without --use_cpu here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, HfArgumentParser,
                          Trainer, TrainingArguments)

from jobgen.train.hf import JobgenCallback


@dataclass
class DataArguments:
    model_name_or_path: str = field(metadata={"help": "a Hub name or a local folder"})
    data_path: str = field(metadata={"help": "a .jsonl file of {\"text\": ...} records, or a .json list of them"})
    max_length: int = field(default=512, metadata={"help": "tokens per example, longer ones cut"})


def read_texts(path: str) -> list[str]:
    with open(path, encoding="utf-8") as source:
        records = json.load(source) if path.endswith(".json") else [json.loads(line) for line in source if line.strip()]
    texts = []
    for record in records:
        turns = record.get("messages") or record.get("conversations")
        texts.append(record["text"] if "text" in record else
                     "\n".join(str(turn.get("content", turn.get("value", ""))) for turn in turns))
    return texts


def main() -> None:
    data, training = HfArgumentParser((DataArguments, TrainingArguments)).parse_args_into_dataclasses()
    # HfArgumentParser takes one word after --report_to (transformers 5): "--report_to wandb,mlflow"
    # names two trackers here.
    training.report_to = [name for given in training.report_to for name in given.split(",") if name]

    tokenizer = AutoTokenizer.from_pretrained(data.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    encoded = tokenizer(read_texts(data.data_path), truncation=True, max_length=data.max_length)
    dataset = [{"input_ids": ids} for ids in encoded["input_ids"]]

    stop = JobgenCallback()
    trainer = Trainer(
        model=AutoModelForCausalLM.from_pretrained(data.model_name_or_path), args=training, train_dataset=dataset,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False), processing_class=tokenizer,
        callbacks=[stop],
    )
    trainer.train(resume_from_checkpoint=training.resume_from_checkpoint)
    # After jobgen's stop request train() returns normally, with checkpoint-N saved: the run is not
    # finished, so no final model; jobgen requeues the job and resumes from checkpoint-N.
    if stop.stopped_at is not None:
        return
    trainer.save_model(os.path.join(training.output_dir, "final"))


if __name__ == "__main__":
    main()
