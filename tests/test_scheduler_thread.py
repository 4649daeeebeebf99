"""The server's torch work (building the model, the warm-up, every step) runs on the scheduler thread, and a
build that fails raises in the caller (a bad flag value is a clear start-up error)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from dflash_helpers import save_standin_target

from sglang_dflash.entrypoints.engine import build_components
from sglang_dflash.entrypoints.http.scheduler_thread import SchedulerThread
from sglang_dflash.scheduler.scheduler import Scheduler
from sglang_dflash.server_args import ServerArgs


def test_build_and_steps_run_on_the_scheduler_thread(tmp_path) -> None:
    args = ServerArgs(model_path=str(save_standin_target(tmp_path, num_layers=2)), speculative_algorithm="NONE",
                      max_total_tokens=1024, dtype="float32")
    threads: dict[str, set[int]] = {"build": set(), "step": set()}
    built = {}

    def build() -> Scheduler:
        threads["build"].add(threading.get_ident())
        built["tm"], scheduler = build_components(args)
        run_step = scheduler.run_step

        def recorded_step():
            threads["step"].add(threading.get_ident())
            return run_step()

        scheduler.run_step = recorded_step
        return scheduler

    scheduler_thread = SchedulerThread(build)

    async def generate() -> list[int]:
        loop, out = asyncio.get_running_loop(), asyncio.Queue()
        req = built["tm"].make_req("Say hello.", sampling_params={"max_new_tokens": 8, "temperature": 0})
        scheduler_thread.add(req, loop, out)
        ids = []
        while not (got := await out.get()).finished:
            ids += got.output_ids
        return ids + got.output_ids

    try:
        assert len(asyncio.run(generate())) == 8
    finally:
        scheduler_thread.shutdown()
    assert threads["build"] == threads["step"] == {scheduler_thread.thread.ident}
    assert scheduler_thread.thread.ident != threading.get_ident()


def test_a_failed_build_raises_in_the_caller() -> None:
    def build() -> Scheduler:
        raise FileNotFoundError("no drafter at /nowhere")

    with pytest.raises(FileNotFoundError, match="/nowhere"):
        SchedulerThread(build)
