"""The tools above both services: the `hybrid-pd` command (cli/) and the benchmarks (bench/).

They start and drive the services and the library; nothing below imports them.
"""
