"""Whether a process is still running, by its pid (a zombie has exited; only its parent's wait is missing)."""


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            state = next(line for line in status if line.startswith("State:"))
    except (OSError, StopIteration):
        return False
    return " Z " not in state
