"""`fmserve train-eagle`: self-distilled EAGLE-3 draft heads, trained on the CPU or a GPU.

    data.py      prompts -> target responses (the offline Engine) -> captured hidden states,
                 in resumable fp16 shards under a work directory
    ttt.py       one training-time-test (TTT) unroll of the head: losses and accuracies
    trainer.py   the loop: AdamW, warmup + cosine, checkpoints, --resume, the shipped head
    evaluate.py  accept length on held-out prompts (the real speculative path, or an estimate)
    threads.py   torch threads that back off while other processes keep cores busy (CPU)
    cli.py       the `train-eagle` subcommand
"""
