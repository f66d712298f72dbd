"""The drafters stage: teacher data, the drafter LM and the recurrent draft head, their losses."""
