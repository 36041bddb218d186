mod storage;
