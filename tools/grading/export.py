"""`nbgrader export` to grades.csv, telling "not submitted" apart from a score of 0.

nbgrader's own CSV exporter writes 0 for a lab a student never handed in, the same as for a
submission that failed every test. `GradesCsv` writes the same columns plus `status`
("submitted" or "not submitted") and leaves the scores of a missing submission empty, so a
spreadsheet averages only what was handed in.
"""

from __future__ import annotations

import csv

from nbgrader.api import Gradebook, MissingEntry
from nbgrader.plugins import ExportPlugin

COLUMNS = [
    "assignment", "duedate", "timestamp", "student_id", "last_name", "first_name", "email",
    "status", "raw_score", "late_submission_penalty", "score", "max_score",
]


class GradesCsv(ExportPlugin):
    """One row per lab and student: the score, or `status` "not submitted" and no score."""

    def export(self, gradebook: Gradebook) -> None:
        destination = self.to or "grades.csv"
        students = [str(student) for student in self.student]
        labs = [str(lab) for lab in self.assignment]
        self.log.info("Exporting grades to %s", destination)
        with open(destination, "w", newline="") as file:
            writer = csv.DictWriter(file, COLUMNS)
            writer.writeheader()
            for lab in gradebook.assignments:
                if labs and lab.name not in labs:
                    continue
                for student in gradebook.students:
                    if students and student.id not in students:
                        continue
                    row = {
                        "assignment": lab.name, "duedate": lab.duedate or "",
                        "student_id": student.id, "last_name": student.last_name or "",
                        "first_name": student.first_name or "", "email": student.email or "",
                        "max_score": lab.max_score,
                    }
                    try:
                        submission = gradebook.find_submission(lab.name, student.id)
                    except MissingEntry:
                        row["status"] = "not submitted"
                    else:
                        penalty = submission.late_submission_penalty or 0.0
                        row.update(
                            status="submitted",
                            timestamp=submission.timestamp or "",
                            raw_score=submission.score,
                            late_submission_penalty=penalty,
                            score=max(0.0, submission.score - penalty),
                        )
                    writer.writerow(row)
