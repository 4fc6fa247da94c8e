from .commands import main

main(prog_name="optimum-parallel")
