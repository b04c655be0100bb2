"""Rules that decide, as plain functions over plain data: the job lifecycle, the states and their
transition table, what a request or turn may cost, and what an input may be."""
