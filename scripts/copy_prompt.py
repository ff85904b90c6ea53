"""The copy-heavy request of BENCHMARKS.md's lookup-draft table: the opening of Pride and Prejudice (about
2,600 characters, cut at a sentence's end), "Repeat the passage above word for word.", and the passage's
first 40 characters again, so that the continuation copies.
    python scripts/copy_prompt.py pride_and_prejudice.txt > copy.txt   (Project Gutenberg's plain text)"""
import sys

text = open(sys.argv[1], encoding="utf-8").read()
start = text.index("It is a truth universally acknowledged")
passage = text[start:start + 2600]
passage = passage[:passage.rfind(".") + 1]
sys.stdout.write(passage + "\n\nRepeat the passage above word for word.\n\n" + passage[:40])
