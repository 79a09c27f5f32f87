"""nbgrader's submit, with submissions that other students cannot read.

nbgrader's exchange keeps the inbound directory unlistable, but makes each submission readable
by everyone who knows its name. `PrivateSubmit` narrows it to the student and the group of the
inbound directory, the instructor's, who collects it. Inbound is set-group-ID, so what is created
in it gets that group; nbgrader's copy (shutil.copytree) copies the student's folder's mode onto
the submission and so drops the bit before nbgrader writes its last files, hence the copy here.
"""

import os
import shutil
import tempfile

from nbgrader.exchange.default.submit import ExchangeSubmit

SUBMISSION_DIR_MODE = 0o770  # student and instructor: read, write (collect, clean up), list
SUBMISSION_FILE_MODE = 0o640  # student: read and write; instructor: read


class PrivateSubmit(ExchangeSubmit):
    def do_copy(self, src: str, dest: str, log=None) -> None:
        if os.path.dirname(dest) != self.inbound_path:  # the student's own cache
            super().do_copy(src, dest, log)
            return
        with tempfile.TemporaryDirectory() as staging:
            copied = os.path.join(staging, "submission")
            super().do_copy(src, copied, log)  # nbgrader's rules: ignored files, size limits
            for folder, _, files in os.walk(copied):
                target = os.path.normpath(os.path.join(dest, os.path.relpath(folder, copied)))
                os.mkdir(target)  # inherits inbound's group and its set-group-ID bit
                for name in files:
                    shutil.copyfile(os.path.join(folder, name), os.path.join(target, name))

    def copy_files(self) -> None:
        super().copy_files()
        submission = os.path.join(self.inbound_path, self.assignment_filename)
        for folder, _, files in os.walk(submission):
            for name in files:
                os.chmod(os.path.join(folder, name), SUBMISSION_FILE_MODE)
            os.chmod(folder, SUBMISSION_DIR_MODE)
