"""Scaling Lab's grading tooling, for instructors only (nbgrader_config.py loads it).

    feedback  feedback without hidden tests, with math that renders offline
    export    grades.csv that tells "not submitted" apart from a score of 0

It is not part of the student release (`make release`), nor of the `minidist` library.
"""
