"""A Ray worker dies with its raylet: one left behind holds its memory and its children for as long as the machine
runs (two were found an hour after a test session, their raylet gone).

The parent here is a plain process standing where the raylet stands (a Ray worker's parent, named by
``RAY_RAYLET_PID``); it is SIGKILLed, as a raylet is when its session is killed."""

import os
import signal
import subprocess
import sys

import psutil

PARENT = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env={**os.environ, "RAY_RAYLET_PID": str(os.getpid())})
print(child.pid, flush=True)
child.wait()
"""
WORKER = """
import time
from rlfw.cluster.worker_setup import setup_process
setup_process()
print("set up", flush=True)
time.sleep(600)
"""


def test_a_worker_dies_with_its_raylet():
    parent = subprocess.Popen([sys.executable, "-c", PARENT, WORKER], stdout=subprocess.PIPE, text=True)
    worker = psutil.Process(int(parent.stdout.readline()))
    try:
        assert parent.stdout.readline() == "set up\n"  # the worker shares its parent's stdout
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        worker.wait(timeout=30)  # psutil.TimeoutExpired: it outlived its raylet
    finally:
        if worker.is_running():
            worker.kill()
