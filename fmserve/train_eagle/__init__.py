"""`fmserve train-eagle`: self-distilled EAGLE-3 draft heads, trained on the CPU or a GPU.

    data.py      prompts -> target responses (the offline Engine) -> captured hidden states,
                 in resumable fp16 shards under a work directory
    capture.py   the teacher-forced prefills on the engine's worker that capture the states
    shards.py    the shards and manifest on disk, read back for training
    ttt.py       one training-time-test (TTT) unroll of the head: losses and accuracies
    head.py      the head: built, started from a trained head, shipped
    schedule.py  the batches of each epoch and the learning-rate schedule
    checkpoints.py  checkpoints on disk (CPU tensors), the last few kept
    trainer.py   the loop: AdamW, warmup + cosine, --resume, time budgets
    evaluate.py  accept length on held-out prompts (the real speculative path, or an estimate)
    portable.py  the data as token ids alone, recaptured on another machine
    synth_prompts.py  instructions the target writes from seed tasks
    threads.py   torch threads that back off while other processes keep cores busy (CPU)
    stages.py    the stages that build an Engine: prompts, tokens, data
    cli.py       the `train-eagle` subcommand
"""

# The data stage's sizes (stages.py), here so that the CLI's help needs no torch import.
GEN_BATCH = {"cpu": 64, "cuda": 256}  # requests generated at once (cpu: the Engine's default)
MIN_GEN_KV_TOKENS = 65536  # the Engine's default KV pool
