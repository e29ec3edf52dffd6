"""placeholder"""


def add_arguments(parser):
    pass


def run(args):
    return 0
