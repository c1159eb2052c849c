"""Process helpers for the lifecycle tests (test_engine, test_isolation)."""

import os


def tagged_processes(tag: str) -> list[int]:
    """Live processes whose environment carries `tag` (rank processes inherit the driver's env)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if tag.encode() in f.read():
                    with open(f"/proc/{entry}/stat") as st:
                        if st.read().rsplit(")", 1)[1].split()[0] != "Z":  # comm may hold spaces
                            found.append(int(entry))
        except OSError:
            continue
    return found
