"""A rank's error line reaches the shared stderr in one write (launch/pretrain_gpt.py).

Under load, two ranks refusing the same run at the same moment produced
``...(this is rank 1).error (rank 0 on vm): ...`` and then a lone newline: print() with an
unbuffered stderr (PYTHONUNBUFFERED=1, as the launchers run) writes the text and the newline
separately, and the other rank's text landed in between."""

from harness import load_script


def _entry():
    return load_script("launch/pretrain_gpt.py", "pretrain_gpt_entry")


def test_error_line_is_one_write_with_its_newline(monkeypatch):
    entry = _entry()
    writes = []

    def record(fd, data):
        writes.append((fd, bytes(data)))
        return len(data)

    monkeypatch.setattr(entry.os, "write", record)
    entry.say_error("1 on vm", ValueError("--save D: this run would replace iter_0000005 (this is rank 1)."))
    assert writes == [(2, b"error (rank 1 on vm): --save D: this run would replace iter_0000005 "
                          b"(this is rank 1).\n")]


def test_a_long_line_is_written_whole_even_when_the_pipe_takes_part(monkeypatch):
    entry = _entry()
    taken = []

    def partial(fd, data):  # a pipe that takes at most 4 KiB per write
        taken.append(bytes(data[:4096]))
        return min(len(data), 4096)

    monkeypatch.setattr(entry.os, "write", partial)
    entry.say_error("0 on vm", "x" * 10000)
    assert b"".join(taken) == b"error (rank 0 on vm): " + b"x" * 10000 + b"\n" and len(taken) == 3
