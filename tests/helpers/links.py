"""Links planted where quantkit writes, to files that are someone else's."""

OUTSIDE = b"someone else's file\n"


def plant_link(path, tmp_path):
    """A link at ``path`` to a file outside; returns the outside file."""
    target = tmp_path / "outside.txt"
    target.write_bytes(OUTSIDE)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)
    return target


def replaced_by_a_picture(path, target) -> bool:
    return target.read_bytes() == OUTSIDE and not path.is_symlink() and path.read_bytes()[:4] == b"\x89PNG"
