# outputs.sh DIR: the estimate's and fit's outputs of the checkout on PYTHONPATH, one file each
D=$1; mkdir -p "$D"
SHAPE="--hidden-size 4096 --intermediate-size 11008 --layers 32 --vocab-size 32000 --heads 32 --prompt-len 2048"
for n in 100 1000 4000 16000; do
  python -m gpumem estimate $SHAPE --new-tokens $n --json > $D/est-$n.json
  python -m gpumem estimate $SHAPE --new-tokens $n > $D/est-$n.txt
done
python -m gpumem estimate $SHAPE --new-tokens 4000 --jobs 1 --json > $D/est-4000-jobs1.json
python -m gpumem estimate --hidden-size 2048 --intermediate-size 5504 --layers 4 --vocab-size 32000 --heads 16 \
  --batch-size 8 --prompt-len 1024 --new-tokens 3000 --json > $D/est-wide-b8.json
python -m gpumem fit $SHAPE --new-tokens 100 --device sim:a100-80gb --json > $D/fit-100.json
python -m gpumem fit $SHAPE --new-tokens 1000 --device sim:a100-80gb --json > $D/fit-1000.json
python -m gpumem fit --hidden-size 1024 --intermediate-size 2816 --layers 2 --vocab-size 32000 --heads 16 \
  --prompt-len 512 --new-tokens 200 --device sim:gtx-1050-2gb --policy gpumem --json > $D/fit-small-gpumem.json
