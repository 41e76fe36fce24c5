"""Prints its arguments as one JSON line, so a test sees exactly what reached the program.

    python echo_argv.py ARG...            -> ["ARG", ...]
    python echo_argv.py --hang PID_FILE   -> writes "<its pid> <a child's pid>" there, then sleeps
"""
import json
import os
import subprocess
import sys
import time

if sys.argv[1:2] == ["--hang"]:
    child = subprocess.Popen(["sleep", "300"])  # same process group: a timeout must end it too
    with open(sys.argv[2], "w") as f:
        f.write(f"{os.getpid()} {child.pid}\n")
    print("hanging", flush=True)
    time.sleep(300)
else:
    print(json.dumps(sys.argv[1:]), flush=True)
