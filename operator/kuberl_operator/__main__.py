import sys

from .cli import main

sys.exit(main(["operator", *sys.argv[1:]]))
