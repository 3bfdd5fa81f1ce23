"""The paper's tables in one command: every GLUE task (and SQuAD) fine-tuned over seeds, the jobs spread over
the devices there are, summarised beside the ConvBERT paper's numbers.

    python -m convbert_ds.evaluate glue --model DIR --glue-dir GLUE --seeds 5 --out OUT --random-init-baseline
    python -m convbert_ds.evaluate all --model DIR --glue-dir GLUE --squad-dir SQUAD --seeds 3 --out OUT

Each (task, init, seed) is one fine-tuning run of ``convbert_ds.finetune`` with the task's paper recipe; the
runs go to one worker process per GPU (``--jobs`` of them on a CPU), largest task first. What OUT holds:

    OUT/evaluation.json            the settings (tasks, seeds, model, recipe options): a rerun with other
                                   settings is refused, a rerun with the same ones resumes
    OUT/converted/TAG/             a training checkpoint --model, converted once for every job
    OUT/jobs/TASK-INIT-seedS/      one fine-tuning run, laid out as ``convbert_ds.finetune``'s OUT
                                   (``run.py``'s docstring); finished once its results.json is there, resumed
                                   through fine-tuning's own state when not
    OUT/jobs/TASK-INIT-seedS/log.txt   what the run printed
    OUT/results.json, results.md   per task the median over seeds and every seed's value, the papers' and the
                                   leaderboard-style averages, the paper's row and the random-init margins
"""
